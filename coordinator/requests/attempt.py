"""One attempt at a request on one placement: open the decode stream, wait until it is accepted, run
the prefill, relay the tokens. Any failure ends it as an AttemptFailed that says whether another
placement could do better, after the circuit breaker has counted it against the instance at fault."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from opentelemetry.trace import Status, StatusCode

from coordinator.errors import WorkerError
from coordinator.requests.failures import FailureKind, WorkerCallError, WorkerFailure, deadline_error
from coordinator.workers.instances import Instance, InstanceRegistry
from coordinator.requests.limits import ModelLimits
from coordinator.metrics import CoordinatorMetrics, NullMetrics
from coordinator.requests.request import (Finished, FinishReason, GenerationEvent, GenerationRequest, TokenDelta,
                                         TokenListener)
from coordinator.requests.trace import GenerationTrace
from coordinator.scheduling.router import Placement
from coordinator.workers.client import FINISH_FROM_PB, DecodeAccepted, DecodeCall, PrefillResult, WorkerClient
from coordinator.workers.request_messages import sampling_to_pb
from proto import worker_pb2 as pb
from telemetry import tracing

if TYPE_CHECKING:
    from coordinator.scheduling.decode_rebalance import DecodeRebalancer, MovableStream
    from coordinator.cluster.wire_formats import ClusterFormats


# How long a failed decode stream waits for its prefill call's own verdict before reporting itself.
PREFILL_VERDICT_WAIT_S = 2.0


class AttemptFailed(Exception):
    """One attempt failed; `blame` is the instance at fault when another one could do better (or, `rebalanced`,
    the decode instance the stream was moved off)."""

    def __init__(self, error: WorkerError, blame: Instance | None = None, retryable: bool = False,
                 rebalanced: bool = False, embeddings_lost: bool = False):
        super().__init__(error.message)
        self.error = error
        self.blame = blame
        self.retryable = retryable and blame is not None
        self.rebalanced = rebalanced
        self.embeddings_lost = embeddings_lost  # the prefill worker could not pull an image's output: send files


@dataclasses.dataclass
class Progress:
    """What the client has already been sent, across attempts."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    decode_times: list[float] = dataclasses.field(default_factory=list)
    prefill_ms: float = 0.0
    first_at: float = 0.0  # time.monotonic of the first token and of the latest one
    last_at: float = 0.0
    batch_sum: int = 0  # the decode batch sizes its tokens were made in, summed (the planner's decode timings)
    attempts: int = 0  # attempts begun (retries, migrations and rebalancing moves make more than one)
    # The last tokens that came with no text: their worker may hold bytes of an unfinished character (or text kept
    # back for a stop string), which a worker continuing the stream is told of (DecodeRequest.held_text_tokens).
    held_text_tokens: int = 0

    @property
    def text_held(self) -> bool:
        """A worker that does not read held_text_tokens could not complete it (decode_rebalance.py waits)."""
        return self.held_text_tokens > 0

    @property
    def count(self) -> int:
        return len(self.token_ids)


class _PrefillInterrupt:
    """Cancels the current task, as asyncio.timeout does, if the prefill it watches fails while armed: the first
    token is then read in the request's own task, not raced by a task of its own against the prefill."""

    __slots__ = ("_task", "_prefill", "_cancelling", "_armed", "_fired")

    def __init__(self, prefill: asyncio.Task):
        self._task = asyncio.current_task()
        self._prefill = prefill
        self._cancelling = self._task.cancelling()  # requests already pending are not its own
        self._armed, self._fired = True, False
        prefill.add_done_callback(self._done)  # runs while the task waits: never cancels it mid-step

    def _done(self, prefill: asyncio.Task) -> None:
        if self._armed and not prefill.cancelled() and prefill.exception() is not None:
            self._armed, self._fired = False, True
            self._task.cancel()

    def disarm(self) -> bool:
        """Stop watching; whether it fired (its cancellation then taken back, unless another one is pending)."""
        if self._armed:
            self._armed = False
            self._prefill.remove_done_callback(self._done)
        fired, self._fired = self._fired, False
        return fired and self._task.uncancel() <= self._cancelling


@dataclasses.dataclass(frozen=True)
class _Deadlines:
    """The clocks of one attempt and what the client is told when each runs out."""

    timeout: float  # the request's own limit in seconds, for messages
    first_token: float  # monotonic time by which the first token must have come
    late: WorkerError

    def left(self) -> float:
        return max(self.first_token - time.monotonic(), 0.0)


class TokenRelay:
    """An attempt's tokens, as the worker sent them, made the client's TokenDeltas, each counted into the request's
    progress, the metrics and the decode instance's signs of life (whether the task or a token channel's frame
    relays it)."""

    __slots__ = ("metrics", "decode", "progress", "wants_logprobs", "admission_ms", "arrived_at", "offset", "last")

    def __init__(self, metrics: CoordinatorMetrics | NullMetrics, decode: Instance, progress: Progress,
                 wants_logprobs: bool, admission_ms: float, arrived_at: float):
        self.metrics = metrics
        self.decode = decode
        self.progress = progress
        self.wants_logprobs = wants_logprobs
        self.admission_ms = admission_ms
        self.arrived_at = arrived_at
        self.offset = progress.count  # tokens sent by earlier attempts
        self.last = time.monotonic()

    def delta(self, token: pb.TokenEvent) -> TokenDelta:
        progress = self.progress
        own_index, time_ms, token_id = token.index, token.time_ms, token.token_id  # each protobuf field read once
        index = self.offset + own_index
        now = time.monotonic()
        if index == 0:
            progress.prefill_ms, progress.first_at = time_ms, now
        else:
            progress.decode_times.append(time_ms)
        self.metrics.token(index, now - self.arrived_at, now - self.last)  # TTFT counts from arrival
        decode = self.decode
        # The silence watch's sign of life, its step cadence below, and the planner's TPOT.
        self.last = decode.last_heard = progress.last_at = now
        if own_index:
            decode.step_ms += (time_ms - decode.step_ms) * 0.1
        progress.token_ids.append(token_id)
        text = token.text
        progress.held_text_tokens = progress.held_text_tokens + 1 if not text else 0
        logprob, top = None, ()
        if self.wants_logprobs:  # a protobuf field read costs (a repeated one makes an object): read when asked for
            logprob, top = token.logprob, tuple([(t.token_id, t.logprob) for t in token.top_logprobs])
        batch = token.batch_size or 1
        progress.batch_sum += batch
        # Positional, in TokenDelta's field order: keywords cost five times as much, once per token.
        delta = TokenDelta(token_id, text, index, time_ms, logprob, top, token.finish_reason != 0,
                           batch, token.queue_wait_ms if own_index else self.admission_ms)
        if index == 0 and token.prompt_logprobs:
            delta.prompt_logprobs = tuple((p.logprob, p.rank, tuple((t.token_id, t.logprob) for t in p.top))
                                          for p in token.prompt_logprobs)
        return delta


class AttemptRunner:
    """Runs attempts on the workers a router picked, keeping each instance's lease and circuit breaker."""

    def __init__(self, client: WorkerClient, registry: InstanceRegistry, limits: ModelLimits,
                 first_token_timeout: float, metrics: CoordinatorMetrics | NullMetrics):
        self.client = client
        self.registry = registry
        self.limits = limits
        self.first_token_timeout = first_token_timeout
        self.metrics = metrics
        self.rebalancer: DecodeRebalancer | None = None  # with rebalance_config.enabled
        self.formats: ClusterFormats | None = None  # pdserve workers: the wire versions the cluster may write

    async def run(self, request: GenerationRequest, placement: Placement, max_tokens: int, deadline: float,
                  timeout: float, progress: Progress, original_prompt_len: int, trace: GenerationTrace,
                  listener: TokenListener | None = None, movable: bool = False) -> AsyncIterator[GenerationEvent]:
        """Yield the attempt's events, continuing `progress`, timing its phases on `trace`; raises AttemptFailed.
        With a `listener`, tokens it accepts go to it instead, as they arrive. `movable`: the rebalancer may move
        the stream once it relays (AttemptFailed with `rebalanced`)."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AttemptFailed(deadline_error(timeout))
        first_deadline = min(deadline, time.monotonic() + self.first_token_timeout)
        # Which limit ends the wait for the first token decides what the client is told.
        late = deadline_error(timeout) if first_deadline == deadline else self._first_token_late(placement)
        clocks = _Deadlines(timeout, first_deadline, late)
        prefill_task: asyncio.Task | None = None
        moving: MovableStream | None = None
        try:
            with self.registry.lease(placement.decode):
                # The Decode call's deadline ends the request everywhere: the decode worker cancels and frees it.
                started = time.monotonic()
                # Once, for the decode and the prefill; vLLM instances are sent JSON bodies instead.
                sampling = sampling_to_pb(request, max_tokens) if self.client.takes_sampling_pb else None
                request = self._in_formats(request, placement)
                stream = self.client.open_decode(placement.decode.address, request, max_tokens, self.limits.max_seq_len,
                                                 remaining, local_prefill=placement.prefill is None,
                                                 traceparent=trace.attempt_traceparent(), sampling=sampling)
                # The phase under way, and since when: a failure or the client leaving ends it where it stands.
                phase, since = "decode_admission", started
                try:
                    accepted = await self._read_within(stream, placement, clocks)
                    if accepted is None:
                        raise AttemptFailed(WorkerError(f"decode worker {placement.decode.address} closed the stream "
                                                        "before accepting"), placement.decode, retryable=True)
                    accepted_at = time.monotonic()
                    trace.phase(phase, since, accepted_at)
                    phase, since = "first_token", accepted_at
                    # The decode worker now holds KV budget for this request and waits for its cache.
                    if placement.prefill is not None:
                        self.metrics.wire_format("kv_layout", accepted.kv_layout_version)
                        prefill_task = asyncio.create_task(self._prefill(placement, request, max_tokens, accepted,
                                                                         trace, sampling))
                    first = await self._first_token(stream, prefill_task, placement, clocks)
                    first_at = time.monotonic()
                    trace.phase(phase, since, first_at)
                    phase, since = "decode", first_at
                    relay = TokenRelay(self.metrics, placement.decode, progress, request.sampling.logprobs is not None,
                                       (accepted_at - started) * 1000, request.arrived_at)
                    if movable and self.rebalancer is not None:
                        moving = self.rebalancer.relaying(progress, progress.count + max_tokens,
                                                          placement.decode.address)
                    async for event in self._relay(stream, first, placement, original_prompt_len, relay, clocks,
                                                   listener, moving):
                        if event.__class__ is Finished:
                            trace.phase(phase, since, time.monotonic())
                            phase = None
                        yield event
                finally:
                    stream.cancel()
                    if phase is not None:
                        trace.phase(phase, since, time.monotonic())
        finally:
            if moving is not None:
                self.rebalancer.done(moving)
            if prefill_task is not None:
                if not prefill_task.done():
                    prefill_task.cancel()
                    await asyncio.gather(prefill_task, return_exceptions=True)
                elif not prefill_task.cancelled():
                    prefill_task.exception()  # retrieved, so a failed prefill is never reported as unhandled

    def _in_formats(self, request: GenerationRequest, placement: Placement) -> GenerationRequest:
        """The request as its workers read it: draft hints only where the cluster writes decode requests of
        version 2 (an older worker would drop them; a new format waits for the whole cluster); images named to an
        encode worker only where it writes embeddings 1 (else, and to a decode worker prefilling, their files)."""
        if any(m.encoder for m in request.media):
            prefill = placement.prefill
            embeddings = 0 if prefill is None or self.formats is None else self.formats.version_with(
                "embeddings", prefill.versions)
            self.metrics.wire_format("embeddings", embeddings)
            if embeddings < 1:
                request = request.with_encoders({})
        version = None
        if self.formats is not None:  # None: vLLM instances, or a pipeline built outside an app
            version = self.formats.version_with("decode_request", placement.decode.versions)
            self.metrics.wire_format("decode_request", version)
        if version is not None and version < 3 and request.held_text_tokens:
            request = dataclasses.replace(request, held_text_tokens=0)  # it would start the text after the prompt
        if not request.draft_hints:
            return request
        if version is not None and version < 2:
            return dataclasses.replace(request, draft_hints=())
        self.metrics.hints_sent(len(request.draft_hints))
        return request

    async def _prefill(self, placement: Placement, request: GenerationRequest, max_tokens: int,
                       accepted: DecodeAccepted, trace: GenerationTrace, sampling: pb.SamplingParams) -> PrefillResult:
        span = trace.start_prefill()
        started = time.monotonic()
        try:
            # Its load is what it must compute: the prompt less what it was expected to hold or to pull.
            uncached = len(request.prompt_token_ids) - placement.prefill_covered_tokens
            with self.registry.lease(placement.prefill, prompt_tokens=uncached):
                try:
                    done = await self.client.prefill(
                        placement.prefill.address, request, max_tokens, placement.decode.address,
                        self.first_token_timeout, kv_data_address=accepted.kv_data_address,
                        kv_transfer_token=accepted.kv_transfer_token, traceparent=tracing.traceparent_of(span),
                        decode_cached_tokens=accepted.cached_tokens,
                        sampling=sampling, kv_layout_version=accepted.kv_layout_version,
                        pull_from=placement.pull_from, pull_tokens=placement.pull_tokens)
                finally:
                    placement.prefill.last_heard = time.monotonic()  # an answer, for the silence watch
            trace.add_time("prefill_queue", (done.prefill_time_ms - done.forward_ms) / 1000)
            trace.add_time("prefill_forward", done.forward_ms / 1000)
            trace.add_time("kv_transfer", done.kv_transfer_ms / 1000)
            trace.kv_bytes += done.kv_bytes
            if span is not None:
                span.set_attribute("pdserve.kv_bytes", done.kv_bytes)
            return done
        except Exception as exc:
            if span is not None:
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, str(exc)))
            raise
        finally:
            trace.add_time("prefill", time.monotonic() - started)
            if span is not None:
                span.end()

    async def _read_within(self, stream: DecodeCall, placement: Placement, clocks: _Deadlines):
        try:
            async with asyncio.timeout(clocks.left()):  # no task of its own per read, as wait_for would make
                return await stream.read()
        except TimeoutError:
            raise AttemptFailed(clocks.late) from None
        except WorkerCallError as exc:
            raise self._failed(placement, exc.failure, clocks) from None

    async def _first_token(self, stream: DecodeCall, prefill_task: asyncio.Task | None, placement: Placement,
                           clocks: _Deadlines) -> pb.TokenEvent | None:
        """The first token event, racing the decode stream against the prefill and the clock."""
        if prefill_task is None or prefill_task.done():
            if prefill_task is not None:
                self._raise_if_prefill_failed(prefill_task, placement, clocks)
            return await self._read_within(stream, placement, clocks)
        # Read in this task, which a failed prefill interrupts; a finished one hands over to the decode worker.
        interrupt = _PrefillInterrupt(prefill_task)
        try:
            async with asyncio.timeout(clocks.left()):
                return await stream.read()
        except (asyncio.CancelledError, TimeoutError, WorkerCallError) as exc:
            if interrupt.disarm():
                self._raise_if_prefill_failed(prefill_task, placement, clocks)
            if isinstance(exc, TimeoutError):
                raise AttemptFailed(clocks.late) from None
            if not isinstance(exc, WorkerCallError):
                raise
            # A failed prefill explains a failed decode better than the decode error does (a prefill that
            # refused the request's grammar truncates the KV stream too); its answer is moments behind.
            if exc.failure.kind is FailureKind.KV_NOT_RECEIVED:
                await asyncio.wait({prefill_task}, timeout=min(PREFILL_VERDICT_WAIT_S, clocks.left()))
            self._raise_if_prefill_failed(prefill_task, placement, clocks)
            raise self._failed(placement, exc.failure, clocks) from None
        finally:
            interrupt.disarm()

    async def _relay(self, stream: DecodeCall, token: pb.TokenEvent | None, placement: Placement, prompt_len: int,
                     relay: TokenRelay, clocks: _Deadlines, listener: TokenListener | None,
                     moving: MovableStream | None):
        if listener is not None:
            # From here on the tokens but the last may go straight from their frames to the client (the
            # task sees only what the listener leaves: the last token, a failure, a token of a slow client).
            take = functools.partial(listener.take, to_delta=relay.delta)
            stream.deliver_directly(take if moving is None else moving.guard(take), listener.flush)
        progress = relay.progress
        while True:
            if token is None:
                raise AttemptFailed(WorkerError(f"decode worker {placement.decode.address} ended the stream without "
                                                "a final token"), placement.decode, retryable=True)
            delta = relay.delta(token)
            yield delta
            if delta.final:
                self.metrics.generation_done(prompt_len)
                yield Finished(
                    # A reason this coordinator does not know (a newer worker's) still ends the generation.
                    reason=FINISH_FROM_PB.get(token.finish_reason, FinishReason.EOS),
                    prompt_tokens=prompt_len,
                    completion_tokens=delta.index + 1,
                    matched_stop=token.matched_stop or None,
                    prefill_time_ms=progress.prefill_ms,
                    decode_time_ms=tuple(progress.decode_times),
                )
                return
            if moving is None:
                try:
                    token = await stream.read()
                except WorkerCallError as exc:
                    raise self._failed(placement, exc.failure, clocks) from None
                continue
            if moving.wanted:
                raise self._moved(placement)
            moving.reading()
            try:
                token = await stream.read()
            except WorkerCallError as exc:
                moving.read_done()
                raise self._failed(placement, exc.failure, clocks) from None
            except asyncio.CancelledError:
                if moving.interrupted():
                    raise self._moved(placement) from None
                raise
            moving.read_done()

    @staticmethod
    def _moved(placement: Placement) -> AttemptFailed:
        return AttemptFailed(WorkerError(f"moved off decode worker {placement.decode.address} to even out the decode "
                                         "load"), placement.decode, retryable=True, rebalanced=True)

    def _first_token_late(self, placement: Placement) -> WorkerError:
        where = f"prefill {placement.prefill.address} / " if placement.prefill is not None else ""
        return WorkerError(f"no first token from {where}decode {placement.decode.address} within "
                           f"first_token_timeout={self.first_token_timeout}s", status=504)

    def _raise_if_prefill_failed(self, prefill_task: asyncio.Task, placement: Placement, clocks: _Deadlines) -> None:
        if not prefill_task.done() or prefill_task.cancelled() or prefill_task.exception() is None:
            return
        exc = prefill_task.exception()
        if not isinstance(exc, WorkerCallError):
            raise AttemptFailed(WorkerError(f"prefill worker {placement.prefill.address} failed: {exc}"))
        raise self._failed(placement, exc.failure, clocks)

    def _failed(self, placement: Placement, failure: WorkerFailure, clocks: _Deadlines) -> AttemptFailed:
        """Count a classified failure against the instance at fault; whether to retry follows from the blame."""
        kind = failure.kind
        if kind is FailureKind.DEADLINE:
            return AttemptFailed(deadline_error(clocks.timeout))
        if kind is FailureKind.MOVED:  # the decode worker asked for it: go on elsewhere, nothing counted against it
            return AttemptFailed(failure.error(), placement.decode, retryable=True)
        if kind is FailureKind.EMBEDDINGS_LOST:  # the encode worker's loss: the same instances, with the files
            return AttemptFailed(failure.error(), placement.prefill, retryable=True, embeddings_lost=True)
        if kind is FailureKind.ELSEWHERE:  # that instance cannot serve this request (its adapter): another may
            return AttemptFailed(failure.error(), placement.instance(failure.stage), retryable=True)
        role = kind.blamed_role(failure.stage)
        blamed = placement.instance(role) if role is not None else None
        if blamed is not None:
            self.registry.record_failure(blamed, failure.circuit_reason, gone=kind.opens_circuit)
        return AttemptFailed(failure.error(), blamed, retryable=True)
