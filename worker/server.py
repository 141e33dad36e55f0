"""The worker process: a thin grpc.aio servicer over the prefill or decode engine."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from kv_transfer.base import KV_SEND_FAILED, KvTransferError
from kv_transfer.buffer_pool import KvBufferPool
from kv_transfer.codec import KvLayer, make_header, make_trailer
from kv_transfer.grpc_transport import GRPC_OPTIONS, GrpcKvSender, KvReceiverServicer
from kv_transfer.tcp_transport import TcpKvReceiver, TcpKvSender
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from worker.decode_service import GatedDecodeServicer
from worker.drain import DrainGate, refuse_if_draining
from worker.lifecycle import serve_until_stopped
from worker.engine import DecodeEngine, PrefillEngine, PrefillJob
from worker.kv_budget import KvCapacityError, default_capacity_tokens
from worker.metrics import WorkerMetrics
from worker.model_runner import ModelRunner
from worker.sequence import FinishReason, SamplingParams, TokenOutput

logger = logging.getLogger(__name__)

_FINISH_TO_PB = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP_STRING: pb.FINISH_REASON_STOP_STRING,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP_TOKEN: pb.FINISH_REASON_STOP_TOKEN,
}


@dataclass(frozen=True)
class WorkerOptions:
    """Command-line settings of one worker process."""

    role: str
    model_dir: str
    host: str = "127.0.0.1"
    port: int = 0
    dtype: str = "auto"
    kv_trans_timeout_s: float = 10.0
    kv_lease_timeout_s: float = 30.0
    kv_chunk_bytes: int = 4 * 1024 * 1024
    kv_budget_tokens: int | None = None  # None: a share of the memory free at start-up
    max_prefill_tokens: int = 8192
    max_prefill_batch_size: int = 16
    max_running: int = 64
    kv_data_port: int = 0  # decode: raw-TCP KV receiver port; 0 picks one, -1 disables (gRPC PushKv only)
    metrics_port: int = 0  # Prometheus /metrics; 0 picks one, -1 disables
    coordinator_url: str | None = None  # the coordinator's management URL to register with; None: no registration
    advertise_host: str | None = None  # the host others reach this worker at (e.g. a pod IP); None: `host`
    heartbeat_interval_s: float = 2.0  # until the coordinator's register answer names its own interval
    drain_seconds: float = 30.0  # on SIGTERM: longest wait for requests in flight before stopping anyway


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.has_seed else None,
        max_tokens=msg.max_tokens,
        stop=tuple(msg.stop),
        skip_special_tokens=msg.skip_special_tokens,
        repetition_penalty=msg.repetition_penalty or 1.0,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        return_logprobs=msg.return_logprobs,
        top_logprobs=msg.top_logprobs,
    )


def token_to_pb(output: TokenOutput) -> pb.DecodeEvent:
    event = pb.TokenEvent(
        token_id=output.token_id,
        text=output.text,
        time_ms=output.time_ms,
        finish_reason=_FINISH_TO_PB[output.finish_reason],
        index=output.index,
        matched_stop=output.matched_stop or "",
        batch_size=output.batch_size,
        queue_wait_ms=output.queue_wait_ms,
    )
    if output.logprobs is not None:
        event.logprob = output.logprobs.logprob
        event.top_logprobs.extend(pb.TopLogprob(token_id=t, logprob=lp) for t, lp in output.logprobs.top)
    return pb.DecodeEvent(token=event)



class PrefillServicer(pb_grpc.PrefillServiceServicer):
    """Prefill, then push the KV cache to the decode worker the coordinator chose."""

    def __init__(self, engine: PrefillEngine, grpc_sender: GrpcKvSender, tcp_sender: TcpKvSender,
                 lease_timeout_s: float, metrics: WorkerMetrics, gate: DrainGate):
        self.metrics = metrics
        self.engine = engine
        self.grpc_sender = grpc_sender
        self.tcp_sender = tcp_sender
        self.lease_timeout_s = lease_timeout_s
        self.gate = gate

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        await refuse_if_draining(self.gate, context)
        with self.gate.request():
            return await self._prefill(request, context)

    async def _prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        if not request.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids is empty")
        try:
            job = await self.engine.submit(request.request_id, list(request.prompt_token_ids),
                                           sampling_from_pb(request.sampling))
        except KvCapacityError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        stream = PrefillKvStream(job, self.engine.runner)
        if request.kv_data_address:
            send = self.tcp_sender.send_items(request.kv_data_address, stream.items())
        else:
            send = self.grpc_sender.send_items(request.decode_address, stream.items())
        start = time.perf_counter()
        try:
            sent = await asyncio.wait_for(send, self.lease_timeout_s)
            self.metrics.kv_bytes.inc(sent)
            self.metrics.kv_duration.observe(time.perf_counter() - start)
        except asyncio.TimeoutError:
            self.metrics.kv_failures.inc()
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"KV lease of request {request.request_id} expired after {self.lease_timeout_s}s before "
                f"decode worker {request.decode_address} confirmed receipt",
            )
        except KvTransferError as exc:
            self.metrics.kv_failures.inc()
            reason = stream.error or str(exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"{KV_SEND_FAILED} {request.decode_address}: {reason}")
        finally:
            self.engine.release(job)
        return pb.PrefillResponse(first_token_id=stream.first_token_id, prefill_time_ms=stream.prefill_time_ms,
                                  kv_bytes=sent, kv_transfer_ms=(time.perf_counter() - start) * 1000)

    async def Health(self, request, context) -> pb.HealthResponse:
        budget = self.engine.admission.budget
        return pb.HealthResponse(
            role="prefill", model=str(self.engine.runner.model_dir), num_running=self.engine.num_running,
            num_waiting=self.engine.admission.num_waiting + len(self.engine.scheduler.queue),
            kv_capacity_tokens=budget.capacity, kv_used_tokens=budget.used, num_kv_leases=len(self.engine.leases),
            queued_prompt_tokens=self.engine.num_queued_tokens, draining=self.gate.draining,
        )


class PrefillKvStream:
    """The KV items of one prefill job, produced while its forward runs."""

    def __init__(self, job: PrefillJob, runner):
        self.job = job
        self.runner = runner
        self.first_token_id = -1
        self.prefill_time_ms = 0.0
        self.error: str | None = None

    async def items(self):
        job = self.job
        yield make_header(job.request_id, self.runner.dtype, self.runner.num_layers,
                          self.runner.kv_shape(job.num_tokens))
        while True:
            item = await job.events.get()
            if item[0] == "layer":
                yield KvLayer(item[1], item[2], item[3])
            elif item[0] == "done":
                self.first_token_id, self.prefill_time_ms = item[1], item[2]
                logprobs = item[3]
                yield make_trailer(item[1], item[2], (logprobs.logprob, logprobs.top) if logprobs else None)
                return
            else:
                # Ending without a trailer makes the decode worker reject the stream as truncated.
                self.error = item[1]
                return


class DecodeServicer(GatedDecodeServicer):
    """Register a request, wait for its KV cache (or prefill it here), stream its tokens."""

    def __init__(self, engine: DecodeEngine, kv_trans_timeout_s: float, kv_data_address: str, gate: DrainGate):
        super().__init__(kv_trans_timeout_s, kv_data_address, gate)
        self.engine = engine

    async def _decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        sampling = sampling_from_pb(request.sampling)
        try:
            handle = self.engine.register(request.request_id, request.prompt_len, sampling, request.max_seq_len,
                                          list(request.prompt_token_ids))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        try:
            try:
                await self.engine.admit(handle)
            except KvCapacityError as exc:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            yield pb.DecodeEvent(accepted=pb.Accepted(kv_data_address=self.kv_data_address))
            if request.local_prefill:
                self.engine.prefill_locally(handle)
            await self.wait_for_kv(handle, request.request_id, context)
            while True:
                item = await handle.events.get()
                if isinstance(item, KvTransferError):
                    await context.abort(grpc.StatusCode.DATA_LOSS, str(item))
                if isinstance(item, Exception):
                    await context.abort(grpc.StatusCode.INTERNAL, str(item))
                yield token_to_pb(item)
                if item.finish_reason is not None:
                    return
        finally:
            self.engine.release(request.request_id)

    async def Health(self, request, context) -> pb.HealthResponse:
        budget = self.engine.admission.budget
        return pb.HealthResponse(
            role="decode", model=str(self.engine.runner.model_dir), num_running=self.engine.scheduler.num_running,
            num_waiting=self.engine.admission.num_waiting + self.engine.num_pending_kv + self.engine.scheduler.num_waiting,
            kv_capacity_tokens=budget.capacity, kv_used_tokens=budget.used, draining=self.gate.draining,
        )


async def serve(options: WorkerOptions) -> None:
    """Load the model, serve (registered with the coordinator if one is named) until SIGTERM/SIGINT,
    then deregister, drain the requests in flight for up to `drain_seconds`, and stop."""
    runner = ModelRunner(options.model_dir, options.dtype)
    # A worker listening on 0.0.0.0 must tell others an address they can dial.
    public_host = options.advertise_host or options.host
    budget = options.kv_budget_tokens or default_capacity_tokens(runner.kv_bytes_per_token())
    server = grpc.aio.server(options=GRPC_OPTIONS)
    gate = DrainGate()
    closers = []
    if options.role == "prefill":
        engine = PrefillEngine(runner, budget, options.max_prefill_tokens, options.max_prefill_batch_size)
        metrics = engine.metrics = WorkerMetrics("prefill", engine)
        engine.start()
        grpc_sender = GrpcKvSender(chunk_bytes=options.kv_chunk_bytes, timeout_s=options.kv_lease_timeout_s)
        servicer = PrefillServicer(engine, grpc_sender, TcpKvSender(options.kv_chunk_bytes), options.kv_lease_timeout_s,
                                   metrics, gate)
        pb_grpc.add_PrefillServiceServicer_to_server(servicer, server)
        closers.append(grpc_sender.close)
    elif options.role == "decode":
        engine = DecodeEngine(runner, budget, options.max_running, options.max_prefill_tokens,
                              options.max_prefill_batch_size)
        metrics = engine.metrics = WorkerMetrics("decode", engine)
        engine.start()
        kv_data_address = ""
        pool = KvBufferPool()

        def on_kv(kv):
            engine.on_kv(kv)
            metrics.kv_bytes.inc(kv.num_bytes)

        def on_failure(request_id: str, message: str):
            metrics.kv_failures.inc()
            engine.fail(request_id, message)

        if options.kv_data_port >= 0:
            receiver = TcpKvReceiver(on_kv, on_failure, timeout_s=options.kv_trans_timeout_s, pool=pool)
            kv_data_address = f"{public_host}:{await receiver.start(options.host, options.kv_data_port)}"
            closers.append(receiver.stop)
        servicer = DecodeServicer(engine, options.kv_trans_timeout_s, kv_data_address, gate)
        pb_grpc.add_DecodeServiceServicer_to_server(servicer, server)
        pb_grpc.add_KvReceiverServicer_to_server(KvReceiverServicer(on_kv, on_failure, pool=pool), server)
    else:
        raise ValueError(f"role must be 'prefill' or 'decode', got {options.role!r}")

    await serve_until_stopped(server, options, gate, metrics, public_host, closers, engine)
