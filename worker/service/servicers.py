"""The worker's gRPC servicers, thin and backend-agnostic: convert from protobuf, call the engine, convert back.

Conversion between protobuf and the engines' domain objects happens only here (`*_from_pb`, `*_to_pb`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from kv_transfer.base import KvTransferError
from kv_transfer.grpc_transport import GrpcKvSender
from kv_transfer.tcp_transport import TcpKvSender
from kv_transfer.transfer_tokens import KvTransferTokens
from kv_transfer.wire import KV_LAYOUT_VERSION, header, layout_mismatch, make_trailer
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from proto.failure_reason import reason_metadata
from proto.wire_versions import MAX_HELD_TEXT_TOKENS, add_to_health
from worker.engine.decode_backend import DecodeBackend, DecodeHandle
from worker.engine.load import WorkerLoad
from worker.engine.messages import KvLayerReady, PrefillDone, PrefillEvent, PrefillFailed
from worker.engine.prefill_backend import PrefillBackend, PrefillJob
from worker.metrics import WorkerMetrics
from worker.service.drain import DrainGate, refuse_if_draining
from worker.service.embedding_pull import EmbeddingPuller
from worker.service.request_checks import checked_lora, checked_media, checked_sampling
from worker.service.kv_peer import PeerPuller
from worker.service.errors import abort_with, engine_errors_as_status
from worker.service.request_spans import (DecodeTimes, PrefillTimes, failure_text, record_decode, record_prefill,
                                           record_safely, traced)
from worker.service.token_channel import ChannelCallContext, CoordinatorConnection, serve_as_call
from worker.service.token_events import relayed, token_to_pb

# What a decode request's draft_hints may hold (the coordinator's bounds are lower).
MAX_DRAFT_HINTS = 16
MAX_DRAFT_HINT_TOKENS = 8192

logger = logging.getLogger(__name__)

def load_to_pb(load: WorkerLoad, draining: bool) -> pb.HealthResponse:
    health = pb.HealthResponse(
        role=load.role, model=load.model, num_running=load.num_running, num_waiting=load.num_waiting,
        kv_capacity_tokens=load.kv_capacity_tokens, kv_used_tokens=load.kv_used_tokens,
        num_kv_leases=load.num_kv_leases, queued_prompt_tokens=load.queued_prompt_tokens, draining=draining,
        num_preemptions=load.num_preemptions,
    )
    add_to_health(health)
    if load.pool is not None:
        pool = load.pool
        health.kv_block_size, health.kv_blocks, health.kv_free_blocks = pool.block_size, pool.num_blocks, pool.free_blocks
        health.kv_cached_blocks = pool.cached_blocks
        health.prefix_hit_tokens, health.prefix_queried_tokens = pool.hit_tokens, pool.queried_tokens
        health.kv_tier_blocks, health.tier_hit_tokens = pool.tier_blocks, pool.tier_hit_tokens
    if load.loras is not None:
        loras = load.loras
        health.max_loras = loras.max_loras
        health.lora_resident.extend(tuple(loras.resident))
        health.lora_running.extend(loras.running)
        health.lora_waiting.extend(tuple(loras.waiting))
    return health


class AnswersHealth:
    """Health for a servicer with an `engine` and a drain `gate`: as a gRPC call, and now (for its token channels)."""

    async def Health(self, request, context) -> pb.HealthResponse:
        return self.health_now()

    def health_now(self) -> pb.HealthResponse:
        return load_to_pb(self.engine.load(), self.gate.draining)


class PrefillKvStream:
    """The KV items of one prefill job, produced while its forward runs: header, layers, trailer."""

    def __init__(self, job: PrefillJob, header: pb.KvHeader):
        self.job = job
        self.header = header
        self.first_token_id = -1
        self.prefill_time_ms = 0.0
        self.done: PrefillDone | None = None
        self.error: str | None = None
        self.invalid = False  # the failure is the request's own (its grammar), not this worker's nor the link's
        self._first: PrefillEvent | None = None

    async def first_event(self) -> None:
        """Wait until the job's KV starts coming (its prompt may wait in the queue and run chunk by chunk first):
        the stream, and the decode worker's clock for it, start only then."""
        self._first = await self.job.events.get()

    async def items(self):
        yield self.header
        event = self._first
        while True:
            match event:
                case KvLayerReady(layer):
                    yield layer
                case PrefillDone(first_token_id, prefill_ms, logprobs) as done:
                    self.first_token_id, self.prefill_time_ms, self.done = first_token_id, prefill_ms, done
                    yield make_trailer(first_token_id, prefill_ms, (logprobs.logprob, logprobs.top) if logprobs else None,
                                       done.prompt_logprobs)
                    return
                case PrefillFailed(message, invalid):
                    # Ending without a trailer makes the decode worker reject the stream as truncated.
                    self.error, self.invalid = message, invalid
                    return
            event = await self.job.events.get()


class PrefillServicer(AnswersHealth, pb_grpc.PrefillServiceServicer):
    """Prefill, then push the KV cache to the decode worker the coordinator chose."""

    def __init__(self, engine: PrefillBackend, grpc_sender: GrpcKvSender, tcp_sender: TcpKvSender,
                 lease_timeout_s: float, metrics: WorkerMetrics, gate: DrainGate, puller: PeerPuller | None = None,
                 embeddings: EmbeddingPuller | None = None):
        self.engine = engine
        self.puller = puller
        self.embeddings = embeddings  # images' encoder outputs from encode workers
        self.token_channel_address = ""  # its token channel listener, named in every answer once it listens
        self.grpc_sender = grpc_sender
        self.tcp_sender = tcp_sender
        self.lease_timeout_s = lease_timeout_s
        self.metrics = metrics
        self.gate = gate

    def health_now(self) -> pb.HealthResponse:
        health = super().health_now()
        if self.puller is not None:
            health.kv_pulls, health.kv_pulled_bytes = self.puller.pulled, self.puller.pulled_bytes
        return health

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        await refuse_if_draining(self.gate, context)
        with self.gate.request():
            return await self._prefill(request, context)

    async def _prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        times = PrefillTimes(time.perf_counter())
        parent = traced(request.traceparent)
        error = None
        try:
            return await self._run_prefill(request, context, times)
        except BaseException as exc:
            error = failure_text(exc, context)
            raise
        finally:
            if parent is not None:
                record_safely(record_prefill, parent, request.request_id, len(request.prompt_token_ids), times,
                              error)

    async def _run_prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext,
                           times: PrefillTimes) -> pb.PrefillResponse:
        if not request.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids is empty")
        mismatch = layout_mismatch(request.kv_layout_version, "decode worker", "writes")
        if mismatch is not None:  # refused before anything is computed: the decode worker could not read the cache
            self.metrics.kv_failures.inc()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(mismatch),
                                trailing_metadata=reason_metadata(pb.FAILURE_REASON_KV_SEND_FAILED))
        if request.pull_from and self.puller is not None:
            await self.puller.pull(request)  # into the prefix cache, where the prefill below finds them
        async with engine_errors_as_status(context):
            sampling = await checked_sampling(self.engine, request.sampling)
            media, prepared = await checked_media(self.engine, request.media, len(request.prompt_token_ids), True,
                                                  self.embeddings, request.request_id)
            lora = await checked_lora(self.engine, request.lora)
            try:
                job = await self.engine.submit(request.request_id, list(request.prompt_token_ids), sampling,
                                               skip_tokens=request.decode_cached_tokens, media=media,
                                               prepared_media=prepared, lora=lora)
            except BaseException:
                if lora is not None:
                    self.engine.loras.release(lora)
                raise
        times.submitted = job.submitted_at
        self.metrics.requests.inc()
        try:
            return await self._send_kv(request, job, context, times)
        finally:
            self.engine.release(job)  # the lease ends whatever happened: sent, expired, refused or cancelled

    async def _send_kv(self, request: pb.PrefillRequest, job: PrefillJob, context: grpc.aio.ServicerContext,
                       times: PrefillTimes) -> pb.PrefillResponse:
        layout = self.engine.kv_layout(job)
        try:
            kv_header = header(job.request_id, layout.dtype_name, layout.num_layers, layout.shape,
                               request.kv_transfer_token, first_position=job.skip_tokens,
                               lora_digest=request.lora.digest if job.lora is not None else b"")
        except KvTransferError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"this prefill worker cannot stream its KV cache: {exc}")
        stream = PrefillKvStream(job, kv_header)
        # Queueing and the prompt's earlier chunks are bounded by the coordinator's first-token deadline; the
        # lease, and the transfer, start with the first layer.
        await stream.first_event()
        if request.kv_data_address:
            send = self.tcp_sender.send_items(request.kv_data_address, stream.items())
        else:
            send = self.grpc_sender.send_items(request.decode_address, stream.items())
        start = times.send_started = time.perf_counter()
        times.transport = "tcp" if request.kv_data_address else "grpc"
        try:
            sent = await asyncio.wait_for(send, self.lease_timeout_s)
            times.send_ended, times.kv_bytes = time.perf_counter(), sent
            self.metrics.kv_bytes.labels("send", times.transport).inc(sent)
            self.metrics.kv_duration.labels("send", times.transport).observe(times.send_ended - start)
        except asyncio.TimeoutError:
            self.metrics.kv_failures.inc()
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"KV lease of request {request.request_id} expired after {self.lease_timeout_s}s before "
                f"decode worker {request.decode_address} confirmed receipt",
                trailing_metadata=reason_metadata(pb.FAILURE_REASON_KV_LEASE_EXPIRED),
            )
        except KvTransferError as exc:
            if stream.invalid:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, stream.error)
            self.metrics.kv_failures.inc()
            reason = stream.error or str(exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"sending KV to decode worker {request.decode_address}: "
                                f"{reason}", trailing_metadata=reason_metadata(pb.FAILURE_REASON_KV_SEND_FAILED))
        finally:
            times.forward = stream.done  # for the trace, whatever became of the transfer
        if stream.error is not None:  # the stream ended without a trailer yet the receiver did not object
            code = grpc.StatusCode.INVALID_ARGUMENT if stream.invalid else grpc.StatusCode.INTERNAL
            await context.abort(code, stream.error)
        return pb.PrefillResponse(first_token_id=stream.first_token_id, prefill_time_ms=stream.prefill_time_ms,
                                  kv_bytes=sent, kv_transfer_ms=(times.send_ended - start) * 1000,
                                  forward_ms=stream.done.forward_ms, token_channel_address=self.token_channel_address)

    async def serve_on_channel(self, channel: CoordinatorConnection, request: pb.PrefillRequest,
                               timeout_s: float) -> None:
        """A prefill that came on a token channel: run as a Prefill call, its answer sent on the channel."""
        async def answer():
            reply = await self.Prefill(request, ChannelCallContext())
            channel.send(pb.RoutedEvent(request_id=request.request_id, prefilled=reply))

        await serve_as_call(channel, "prefill", request.request_id, timeout_s, answer())


class DecodeServicer(AnswersHealth, pb_grpc.DecodeServiceServicer):
    """Register a request, wait for its KV cache (or prefill it here), stream its tokens."""

    def __init__(self, engine: DecodeBackend, kv_data_address: str,
                 tokens: KvTransferTokens, metrics: WorkerMetrics, gate: DrainGate, token_channel_address: str = ""):
        self.engine = engine
        self.token_channel_address = token_channel_address
        self.kv_data_address = kv_data_address
        self.tokens = tokens  # the KV receivers' sink redeems what this issues
        self.metrics = metrics
        self.gate = gate

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        async for event in self._serve(request, context):
            yield event

    async def serve_on_channel(self, channel: CoordinatorConnection, request: pb.DecodeRequest,
                               timeout_s: float) -> None:
        """A decode request that came on a token channel: run as a Decode call, its events sent on the channel."""
        async def events():
            async for event in self._serve(request, ChannelCallContext(), channel):
                channel.send_accepted(request.request_id, event.accepted)  # tokens go by the handle's relay

        await serve_as_call(channel, "decode", request.request_id, timeout_s, events())

    async def _serve(self, request: pb.DecodeRequest, context, channel: CoordinatorConnection | None = None):
        await refuse_if_draining(self.gate, context)
        if request.prompt_len <= 0 or request.prompt_len >= request.max_seq_len:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt_len={request.prompt_len} must be in [1, max_seq_len={request.max_seq_len})",
            )
        if request.local_prefill and request.sampling.return_prompt_logprobs:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt logprobs are computed by a prefill worker "
                                "only: send the request through PD (local_prefill is false)")
        if len(request.draft_hints) > MAX_DRAFT_HINTS or any(len(h.token_ids) > MAX_DRAFT_HINT_TOKENS
                                                            for h in request.draft_hints):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"draft_hints: at most {MAX_DRAFT_HINTS} hints of "
                                f"at most {MAX_DRAFT_HINT_TOKENS} tokens each")
        if not 0 <= request.held_text_tokens <= min(len(request.prompt_token_ids), MAX_HELD_TEXT_TOKENS):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"held_text_tokens must be in [0, min(prompt "
                                f"tokens, {MAX_HELD_TEXT_TOKENS})], got {request.held_text_tokens}")
        if request.local_prefill and len(request.prompt_token_ids) != request.prompt_len:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"local_prefill needs the whole prompt: got {len(request.prompt_token_ids)} prompt_token_ids "
                f"for prompt_len={request.prompt_len}",
            )
        with self.gate.request():
            # aclosing: a stream ended early still runs _decode's cleanup now, not at garbage collection.
            async with contextlib.aclosing(self._decode(request, context, channel)) as events:
                async for event in events:
                    yield event

    def _decode(self, request: pb.DecodeRequest, context, channel: CoordinatorConnection | None):
        """The request's events (an async generator), inside its trace's spans when it is traced."""
        times = DecodeTimes(time.perf_counter())
        parent = traced(request.traceparent)
        events = self._run_decode(request, context, channel, times)
        if parent is None:
            return events  # untraced: no generator layer more per token
        return self._traced_decode(events, parent, request, context, times)

    async def _traced_decode(self, events, parent, request: pb.DecodeRequest, context, times: DecodeTimes):
        error = None
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event
        except BaseException as exc:
            error = failure_text(exc, context)
            raise
        finally:
            record_safely(record_decode, parent, request.request_id, request.prompt_len, request.local_prefill,
                          times, error)

    async def _run_decode(self, request: pb.DecodeRequest, context, channel: CoordinatorConnection | None,
                          times: DecodeTimes):
        async with engine_errors_as_status(context):
            sampling = await checked_sampling(self.engine, request.sampling)
            media, prepared = await checked_media(self.engine, request.media, request.prompt_len,
                                                  request.local_prefill)
            lora = await checked_lora(self.engine, request.lora)
            try:
                handle = self.engine.register(request.request_id, request.prompt_len, sampling, request.max_seq_len,
                                              list(request.prompt_token_ids), media, prepared, lora)
                handle.seq.no_drafts = request.no_drafts
                handle.seq.held_text_tokens = request.held_text_tokens
                handle.seq.draft_hints = tuple(hint.token_ids for hint in request.draft_hints)
            except BaseException:
                if lora is not None:
                    self.engine.loras.release(lora)
                raise
        try:
            async with engine_errors_as_status(context):
                await self.engine.admit(handle)
            times.admitted = time.perf_counter()
            self.metrics.requests.inc()
            # Only the sender the coordinator hands this token to can deliver the KV cache; no stream
            # is taken for a local prefill.
            token = "" if request.local_prefill else self.tokens.issue(
                request.request_id, request.lora.digest if handle.seq.lora is not None else b"")
            # What this worker's prefix cache holds of the prompt is kept for it and not sent again.
            cached = 0 if request.local_prefill else self.engine.hold_cached_prefix(handle)
            if channel is not None:
                handle.relay = lambda output: channel.send(relayed(request.request_id, output, channel.token_records))
            yield pb.DecodeEvent(accepted=pb.Accepted(kv_data_address=self.kv_data_address, kv_transfer_token=token,
                                                      token_channel_address=self.token_channel_address,
                                                      cached_tokens=cached, kv_layout_version=KV_LAYOUT_VERSION))
            if request.local_prefill:
                self.engine.prefill_locally(handle)
            await self._wait_for_kv(handle, context)
            times.cache_ready = time.perf_counter()
            while True:
                item = await handle.events.get()
                if isinstance(item, Exception):
                    await abort_with(context, item)
                if channel is None:
                    yield pb.DecodeEvent(token=token_to_pb(item))
                if item.finish_reason is not None:
                    return
        finally:
            times.receipt, times.first_step_at = handle.kv_receipt, handle.first_step_at
            times.generated = handle.seq.num_generated
            times.drafts = handle.seq.drafts
            self.tokens.revoke(request.request_id)  # the token dies with the request
            self.engine.release(request.request_id)

    async def _wait_for_kv(self, handle: DecodeHandle, context: grpc.aio.ServicerContext) -> None:
        """Wait for the request's KV cache. Until its transfer starts, the prefill worker may be busy with other
        prompts: that wait is bounded by the coordinator's first-token deadline (the call's). Once it has started,
        the receivers bound it by kv_trans_timeout between blocks and fail the request (`fail`) on a stall."""
        await handle.kv_arrived.wait()
