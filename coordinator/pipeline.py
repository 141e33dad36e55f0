"""Drive one request through a prefill worker and a decode worker, as a stream of events."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from coordinator.errors import WorkerError
from coordinator.limits import ModelLimits
from coordinator.request import Finished, GenerationEvent, GenerationRequest, TokenDelta
from coordinator.routing import RoundRobinRouter
from coordinator.worker_client import FINISH_FROM_PB, WorkerClient
from kv_transfer.base import KV_SEND_FAILED

logger = logging.getLogger(__name__)

_TIMEOUT_CODES = (grpc.StatusCode.DEADLINE_EXCEEDED,)


def _worker_error(stage: str, address: str, exc: grpc.aio.AioRpcError) -> WorkerError:
    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        # The worker says this request can never fit its KV budget: the client must ask for less.
        return WorkerError(f"{stage} worker {address} refused the request: {exc.details()}", status=400)
    status = 504 if exc.code() in _TIMEOUT_CODES else 503
    return WorkerError(f"{stage} worker {address} failed: {exc.code().name}: {exc.details()}", status=status)


def _unreachable(exc: BaseException) -> bool:
    """The prefill worker itself could not be reached (not: it ran and the KV transfer failed)."""
    return (isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE
            and not (exc.details() or "").startswith(KV_SEND_FAILED))


class RequestPipeline:
    """Opens the decode stream, starts the prefill, then relays decode tokens as events."""

    def __init__(self, client: WorkerClient, router: RoundRobinRouter, limits: ModelLimits,
                 first_token_timeout: float, infer_timeout: float, metrics=None, max_retry: int = 0):
        self.metrics = metrics
        self.max_retry = max_retry
        self.client = client
        self.router = router
        self.limits = limits
        self.first_token_timeout = first_token_timeout
        self.infer_timeout = infer_timeout

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        route = self.router.route()
        max_tokens = self.limits.generation_cap(request.max_tokens, len(request.prompt_token_ids))
        deadline = min(self.infer_timeout, request.timeout_s or self.infer_timeout)
        # The Decode call's deadline ends the request everywhere: the decode worker cancels and frees it.
        call = self.client.open_decode(route.decode, request, max_tokens, self.limits.max_seq_len, deadline)
        prefill_task: asyncio.Task | None = None
        try:
            try:
                started = asyncio.get_running_loop().time()
                accepted = await asyncio.wait_for(call.read(), self.first_token_timeout)
                admission_ms = (asyncio.get_running_loop().time() - started) * 1000
                if accepted is grpc.aio.EOF:
                    raise WorkerError(f"decode worker {route.decode} closed the stream before accepting")
                # The decode worker now holds KV budget for this request and waits for its cache.
                def start_prefill(address: str) -> asyncio.Task:
                    return asyncio.create_task(self.client.prefill(
                        address, request, max_tokens, route.decode, self.first_token_timeout,
                        kv_data_address=accepted.accepted.kv_data_address))

                tried = [route.prefill]
                prefill_task = start_prefill(route.prefill)
                first, prefill_task = await self._first_token(call, prefill_task, tried, start_prefill)
                async for event in self._relay(call, first, len(request.prompt_token_ids), route.decode,
                                               request.sampling.logprobs, admission_ms):
                    yield event
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "Deadline Exceeded" in (exc.details() or ""):
                    raise WorkerError(f"request exceeded its deadline of {deadline}s and was cancelled",
                                      status=504) from None
                # A failed prefill explains a failed decode better than the decode error does.
                if prefill_task is not None and prefill_task.done() and not prefill_task.cancelled():
                    pexc = prefill_task.exception()
                    if isinstance(pexc, grpc.aio.AioRpcError):
                        raise _worker_error("prefill", tried[-1], pexc) from None
                raise _worker_error("decode", route.decode, exc) from None
            except asyncio.TimeoutError:
                raise WorkerError(
                    f"no first token from prefill {route.prefill} / decode {route.decode} within "
                    f"first_token_timeout={self.first_token_timeout}s",
                    status=504,
                ) from None
        finally:
            call.cancel()
            if prefill_task is not None:
                if not prefill_task.done():
                    prefill_task.cancel()
                # Retrieve the outcome so a failed prefill is never reported as unhandled.
                await asyncio.gather(prefill_task, return_exceptions=True)

    async def _first_token(self, call, prefill_task: asyncio.Task, tried: list[str], start_prefill):
        """Wait for the first decode event; a prefill instance that cannot be reached is replaced by
        another (up to max_retry), any other prefill failure fails the request at once."""
        read = asyncio.ensure_future(call.read())
        while True:
            done, _ = await asyncio.wait({read, prefill_task}, timeout=self.first_token_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            if read in done:
                return read.result(), prefill_task
            if not done:
                read.cancel()
                raise asyncio.TimeoutError
            exc = prefill_task.exception()
            if exc is None:
                return await asyncio.wait_for(read, self.first_token_timeout), prefill_task
            if _unreachable(exc) and len(tried) <= self.max_retry:
                other = self.router.next_prefill(exclude=tried)
                if other is not None:
                    logger.warning("prefill worker %s unreachable (%s); retrying on %s", tried[-1],
                                   exc.details(), other)
                    if self.metrics is not None:
                        self.metrics.retries.inc()
                    tried.append(other)
                    prefill_task = start_prefill(other)
                    continue
            read.cancel()
            if isinstance(exc, grpc.aio.AioRpcError):
                raise _worker_error("prefill", tried[-1], exc)
            raise exc

    async def _relay(self, call, msg, prompt_len: int, decode_address: str,
                     request_logprobs: int | None, admission_ms: float) -> AsyncIterator[GenerationEvent]:
        decode_times: list[float] = []
        prefill_ms = 0.0
        loop = asyncio.get_running_loop()
        started = last = loop.time()
        wants_logprobs = request_logprobs is not None
        while True:
            if msg is grpc.aio.EOF:
                raise WorkerError(f"decode worker {decode_address} ended the stream without a final token")
            token = msg.token
            if token.index == 0:
                prefill_ms = token.time_ms
            else:
                decode_times.append(token.time_ms)
            if self.metrics is not None:
                now = loop.time()
                self.metrics.token(token.index, now - started, now - last)
                last = now
            yield TokenDelta(
                token_id=token.token_id, text=token.text, index=token.index, time_ms=token.time_ms,
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
                    completion_tokens=token.index + 1,
                    matched_stop=token.matched_stop or None,
                    prefill_time_ms=prefill_ms,
                    decode_time_ms=tuple(decode_times),
                )
                return
            msg = await call.read()
