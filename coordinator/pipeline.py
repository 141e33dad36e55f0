"""Drive one request through a prefill worker and a decode worker, as a stream of events.

A request's life in the coordinator:
  1. It waits its turn in the RequestQueue (priority, then arrival), within its deadline.
  2. An attempt: the router picks a decode and a prefill instance (or none, when the decode worker
     prefills a short prompt itself); the decode stream opens and is `accepted` once the decode
     worker holds KV budget; the prefill runs and pushes the KV cache; tokens are relayed.
  3. A failure before the first token (a worker unreachable or gone, a KV transfer that failed or
     stalled) starts a new attempt on other instances, up to `max_retry`, invisibly to the client.
     A decode worker lost mid-stream is replaced: the prompt plus the tokens already sent are
     prefilled again and another decode worker continues the stream (`max_migrations`).
  4. Every stage has a deadline: first_token_timeout, then the request's own timeout / infer_timeout,
     which is also the gRPC deadline of the decode call, so the workers free the request on expiry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import grpc

from coordinator.errors import WorkerError
from coordinator.instances import Instance, InstanceRegistry
from coordinator.limits import ModelLimits
from coordinator.request import Finished, GenerationEvent, GenerationRequest, TokenDelta
from coordinator.request_queue import RequestQueue
from coordinator.scheduling.router import Route, Router
from coordinator.worker_client import FINISH_FROM_PB, WorkerClient
from kv_transfer.base import KV_SEND_FAILED

logger = logging.getLogger(__name__)

# Codes that say the request itself is wrong: retrying elsewhere cannot help.
_REQUEST_FAULTS = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT,
                   grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.OUT_OF_RANGE)
# Codes that say the worker process is gone (killed, restarted, network cut).
_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
         grpc.StatusCode.INTERNAL)


class AttemptFailed(Exception):
    """One attempt failed; `blame` is the instance at fault when another one could do better."""

    def __init__(self, error: WorkerError, blame: Instance | None = None, retryable: bool = False):
        super().__init__(error.message)
        self.error = error
        self.blame = blame
        self.retryable = retryable and blame is not None


@dataclasses.dataclass
class Progress:
    """What the client has already been sent, across attempts."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    decode_times: list[float] = dataclasses.field(default_factory=list)
    prefill_ms: float = 0.0

    @property
    def count(self) -> int:
        return len(self.token_ids)


class RequestPipeline:
    """Queues, routes, retries and migrates requests; relays decode tokens as events."""

    def __init__(self, client: WorkerClient, router: Router, registry: InstanceRegistry, limits: ModelLimits,
                 queue: RequestQueue, first_token_timeout: float, infer_timeout: float, metrics=None,
                 max_retry: int = 0, max_migrations: int = 0):
        self.client = client
        self.router = router
        self.registry = registry
        self.limits = limits
        self.queue = queue
        self.first_token_timeout = first_token_timeout
        self.infer_timeout = infer_timeout
        self.metrics = metrics
        self.max_retry = max_retry
        self.max_migrations = max_migrations

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        max_tokens = self.limits.generation_cap(request.max_tokens, len(request.prompt_token_ids))
        timeout = min(self.infer_timeout, request.timeout_s or self.infer_timeout)
        deadline = request.arrived_at + timeout
        try:
            await self.queue.acquire(request.priority, deadline - time.monotonic())
        except asyncio.TimeoutError:
            raise WorkerError(f"request waited {timeout}s in the coordinator's queue (timeout) and was dropped",
                              status=504) from None
        waited = time.monotonic() - request.arrived_at
        if self.metrics is not None:
            self.metrics.queue_time.observe(waited)
        try:
            async for event in self._attempts(request, max_tokens, deadline, timeout):
                yield event
        finally:
            self.queue.release()

    async def _attempts(self, request, max_tokens: int, deadline: float, timeout: float):
        progress = Progress()
        excluded = {"prefill": set(), "decode": set()}
        retries = migrations = 0
        last: AttemptFailed | None = None
        while True:
            try:
                route = self.router.route(request.prompt_token_ids + progress.token_ids,
                                          exclude_decode=excluded["decode"], exclude_prefill=excluded["prefill"])
            except WorkerError:
                if last is not None:  # no instance left to retry on: the failure itself says more
                    raise last.error from None
                raise
            attempt = request.continued(progress.token_ids, retries + migrations)
            try:
                async for event in self._attempt(attempt, route, max_tokens - progress.count, deadline,
                                                 timeout, progress, len(request.prompt_token_ids)):
                    yield event
                return
            except AttemptFailed as failed:
                last = failed
                if not failed.retryable:
                    raise failed.error from None
                migrating = failed.blame.role == "decode" and progress.count > 0
                if migrating and migrations < self.max_migrations:
                    migrations += 1
                    kind = "migrations"
                elif not migrating and retries < self.max_retry:
                    retries += 1
                    kind = "retries"
                else:
                    raise failed.error from None
                excluded[failed.blame.role].add(failed.blame.address)
                logger.warning("request %s: %s; %s on other instances after %d tokens", request.request_id,
                               failed.error.message, "migrating" if migrating else "retrying", progress.count)
                if self.metrics is not None:
                    getattr(self.metrics, kind).inc()

    async def _attempt(self, request: GenerationRequest, route: Route, max_tokens: int, deadline: float,
                       timeout: float, progress: Progress, original_prompt_len: int):
        decode, prefill = route.decode, route.prefill
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AttemptFailed(_deadline_error(timeout))
        # The Decode call's deadline ends the request everywhere: the decode worker cancels and frees it.
        call = self.client.open_decode(decode.address, request, max_tokens, self.limits.max_seq_len, remaining,
                                       local_prefill=prefill is None)
        decode.outstanding_requests += 1
        decode.num_served += 1
        prefill_task: asyncio.Task | None = None
        first_deadline = min(deadline, time.monotonic() + self.first_token_timeout)
        # Which limit ends the wait for the first token decides what the client is told.
        late = _deadline_error(timeout) if first_deadline == deadline else self._first_token_late(route)
        try:
            started = time.monotonic()
            accepted = await self._read_until(call, first_deadline, late, route, timeout)
            if accepted is grpc.aio.EOF:
                raise AttemptFailed(WorkerError(f"decode worker {decode.address} closed the stream before "
                                                "accepting"), decode, retryable=True)
            admission_ms = (time.monotonic() - started) * 1000
            # The decode worker now holds KV budget for this request and waits for its cache.
            if prefill is not None:
                prefill_task = asyncio.create_task(self._prefill(prefill, request, max_tokens, decode,
                                                                 accepted.accepted.kv_data_address))
            first = await self._first_token(call, prefill_task, first_deadline, late, route, timeout)
            async for event in self._relay(call, first, route, progress, original_prompt_len,
                                           request.sampling.logprobs, admission_ms, timeout):
                yield event
            self.registry.record_success(decode)
        finally:
            decode.outstanding_requests -= 1
            call.cancel()
            if prefill_task is not None:
                if not prefill_task.done():
                    prefill_task.cancel()
                # Retrieve the outcome so a failed prefill is never reported as unhandled.
                await asyncio.gather(prefill_task, return_exceptions=True)

    async def _prefill(self, prefill: Instance, request: GenerationRequest, max_tokens: int, decode: Instance,
                       kv_data_address: str):
        prefill.outstanding_requests += 1
        prefill.outstanding_prompt_tokens += len(request.prompt_token_ids)
        prefill.num_served += 1
        try:
            result = await self.client.prefill(prefill.address, request, max_tokens, decode.address,
                                               self.first_token_timeout, kv_data_address=kv_data_address)
            self.registry.record_success(prefill)
            return result
        finally:
            prefill.outstanding_requests -= 1
            prefill.outstanding_prompt_tokens -= len(request.prompt_token_ids)

    async def _read_until(self, call, until: float, late: WorkerError, route: Route, timeout: float):
        try:
            return await asyncio.wait_for(call.read(), max(until - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            raise AttemptFailed(late) from None
        except grpc.aio.AioRpcError as exc:
            raise self._decode_failed(route, exc, timeout) from None

    async def _first_token(self, call, prefill_task: asyncio.Task | None, until: float, late: WorkerError,
                           route: Route, timeout: float):
        """The first token event; a failed prefill fails the attempt at once."""
        if prefill_task is None:
            return await self._read_until(call, until, late, route, timeout)
        read = asyncio.ensure_future(call.read())
        try:
            done, _ = await asyncio.wait({read, prefill_task}, timeout=max(until - time.monotonic(), 0.0),
                                         return_when=asyncio.FIRST_COMPLETED)
            if read not in done and prefill_task in done:
                if prefill_task.exception() is not None:
                    raise self._prefill_failed(route, prefill_task.exception())
                await asyncio.wait({read}, timeout=max(until - time.monotonic(), 0.0))
            if not read.done():
                raise AttemptFailed(late)
            exc = read.exception()
            if exc is None:
                return read.result()
            if not isinstance(exc, grpc.aio.AioRpcError):
                raise exc
            # A failed prefill explains a failed decode better than the decode error does.
            if prefill_task.done() and not prefill_task.cancelled() and prefill_task.exception() is not None:
                raise self._prefill_failed(route, prefill_task.exception())
            raise self._decode_failed(route, exc, timeout)
        finally:
            if not read.done():
                read.cancel()

    async def _relay(self, call, msg, route: Route, progress: Progress, prompt_len: int,
                     request_logprobs: int | None, admission_ms: float, timeout: float):
        loop_time = time.monotonic
        started = last = loop_time()
        offset = progress.count
        wants_logprobs = request_logprobs is not None
        while True:
            if msg is grpc.aio.EOF:
                raise AttemptFailed(WorkerError(f"decode worker {route.decode.address} ended the stream without "
                                                "a final token"), route.decode, retryable=True)
            token = msg.token
            index = offset + token.index
            if index == 0:
                progress.prefill_ms = token.time_ms
            else:
                progress.decode_times.append(token.time_ms)
            if self.metrics is not None:
                now = loop_time()
                self.metrics.token(index, now - started, now - last)
                last = now
            progress.token_ids.append(token.token_id)
            yield TokenDelta(
                token_id=token.token_id, text=token.text, index=index, time_ms=token.time_ms,
                logprob=token.logprob if wants_logprobs else None,
                top_logprobs=tuple((t.token_id, t.logprob) for t in token.top_logprobs),
                final=bool(token.finish_reason),
                batch_size=token.batch_size or 1,
                queue_wait_ms=admission_ms if token.index == 0 else token.queue_wait_ms,
            )
            if token.finish_reason:
                if self.metrics is not None:
                    self.metrics.prompt_tokens.inc(prompt_len)
                yield Finished(
                    reason=FINISH_FROM_PB[token.finish_reason],
                    prompt_tokens=prompt_len,
                    completion_tokens=index + 1,
                    matched_stop=token.matched_stop or None,
                    prefill_time_ms=progress.prefill_ms,
                    decode_time_ms=tuple(progress.decode_times),
                )
                return
            try:
                msg = await call.read()
            except grpc.aio.AioRpcError as exc:
                raise self._decode_failed(route, exc, timeout) from None

    # Failure classification --------------------------------------------------------------------
    def _first_token_late(self, route: Route) -> WorkerError:
        where = f"prefill {route.prefill.address} / " if route.prefill is not None else ""
        return WorkerError(f"no first token from {where}decode {route.decode.address} within "
                           f"first_token_timeout={self.first_token_timeout}s", status=504)

    def _decode_failed(self, route: Route, exc: grpc.aio.AioRpcError, timeout: float) -> AttemptFailed:
        decode = route.decode
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and "Deadline Exceeded" in details:
            return AttemptFailed(_deadline_error(timeout))
        error = _worker_error("decode", decode.address, exc)
        if code in _REQUEST_FAULTS:
            return AttemptFailed(error)
        if code in _GONE:
            self.registry.record_failure(decode, f"{code.name}: {details}", gone=True)
            return AttemptFailed(error, decode, retryable=True)
        # The decode worker is fine but its KV cache arrived corrupt or never arrived (DATA_LOSS,
        # its receive timeout): the prefill side failed, so another prefill instance may do better.
        if route.prefill is not None:
            self.registry.record_failure(route.prefill, f"KV transfer failed: {details}")
        return AttemptFailed(error, route.prefill, retryable=True)

    def _prefill_failed(self, route: Route, exc: BaseException) -> AttemptFailed:
        prefill = route.prefill
        if not isinstance(exc, grpc.aio.AioRpcError):
            return AttemptFailed(WorkerError(f"prefill worker {prefill.address} failed: {exc}"))
        code, details = exc.code(), exc.details() or ""
        error = _worker_error("prefill", prefill.address, exc)
        if code in _REQUEST_FAULTS:
            return AttemptFailed(error)
        if details.startswith(KV_SEND_FAILED):
            # It ran, but could not hand the KV cache to the decode worker: that one is at fault.
            self.registry.record_failure(route.decode, details)
            return AttemptFailed(error, route.decode, retryable=True)
        self.registry.record_failure(prefill, f"{code.name}: {details}", gone=code in _GONE)
        return AttemptFailed(error, prefill, retryable=True)


def _deadline_error(timeout: float) -> WorkerError:
    return WorkerError(f"request exceeded its deadline of {timeout}s and was cancelled", status=504)


def _worker_error(stage: str, address: str, exc: grpc.aio.AioRpcError) -> WorkerError:
    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        # The worker says this request can never fit its KV budget: the client must ask for less.
        return WorkerError(f"{stage} worker {address} refused the request: {exc.details()}", status=400)
    status = 504 if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else 503
    return WorkerError(f"{stage} worker {address} failed: {exc.code().name}: {exc.details()}", status=status)
