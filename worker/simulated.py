"""`pdserve worker --simulate`: the worker's gRPC protocol and KV streams with no model (and no torch).

Prefill and decode take the time a CostModel says, tokens are synthetic, and the KV streams are
the real framing, sized as the configured model's cache. Light enough to run dozens per core.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
from prometheus_client import Counter

from kv_transfer.base import KV_SEND_FAILED, KvTransferError
from kv_transfer.grpc_transport import GRPC_OPTIONS, GrpcKvSender, KvReceiverServicer
from kv_transfer.tcp_transport import TcpKvReceiver, TcpKvSender
from kv_transfer.wire import DEFAULT_CHUNK_BYTES, header, make_trailer
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from worker.cost_model import CostModel, KvShape
from worker.decode_service import GatedDecodeServicer
from worker.drain import DrainGate, refuse_if_draining
from worker.lifecycle import serve_until_stopped
from worker.kv_budget import KvCapacityError
from worker.metrics import WorkerMetrics
from worker.simulated_engine import SimulatedDecodeEngine, SimulatedPrefillEngine, SimPrefillJob, token_key
from worker.simulated_kv import VerifyingKvSink, synthetic_layer

logger = logging.getLogger(__name__)

SIMULATED_MODEL = "simulated"


@dataclass(frozen=True)
class SimulatedOptions:
    """Command-line settings of one simulated worker process."""

    role: str
    host: str = "127.0.0.1"
    port: int = 0
    cost: CostModel = field(default_factory=CostModel)
    kv_shape: KvShape = field(default_factory=KvShape)
    vocab_size: int = 32000
    kv_budget_tokens: int = 1 << 20  # no device memory to size it from
    max_prefill_tokens: int = 8192
    max_prefill_batch_size: int = 16
    max_running: int = 64
    kv_trans_timeout_s: float = 10.0
    kv_lease_timeout_s: float = 30.0
    kv_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    kv_data_port: int = 0  # decode: raw-TCP KV receiver port; 0 picks one, -1 disables (gRPC PushKv only)
    metrics_port: int = 0  # Prometheus /metrics; 0 picks one, -1 disables
    coordinator_url: str | None = None
    advertise_host: str | None = None  # the host others reach this worker at (e.g. a pod IP); None: `host`
    heartbeat_interval_s: float = 2.0
    drain_seconds: float = 30.0


def add_request_counter(metrics: WorkerMetrics) -> Counter:
    return Counter("pdserve_worker_requests_total", "Requests this worker admitted (gave KV budget to).",
                   registry=metrics.registry)



class SimulatedPrefillServicer(pb_grpc.PrefillServiceServicer):
    """Prefill on the cost model's clock, then push a synthetic KV cache to the named decode worker."""

    def __init__(self, engine: SimulatedPrefillEngine, shape: KvShape, grpc_sender: GrpcKvSender,
                 tcp_sender: TcpKvSender, lease_timeout_s: float, metrics: WorkerMetrics, gate: DrainGate):
        self.engine = engine
        self.shape = shape
        self.grpc_sender = grpc_sender
        self.tcp_sender = tcp_sender
        self.lease_timeout_s = lease_timeout_s
        self.metrics = metrics
        self.requests = add_request_counter(metrics)
        self.gate = gate

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        await refuse_if_draining(self.gate, context)
        with self.gate.request():
            return await self._prefill(request, context)

    async def _prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        if not request.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids is empty")
        seed = request.sampling.seed if request.sampling.has_seed else None
        try:
            job = await self.engine.submit(request.request_id, len(request.prompt_token_ids),
                                           token_key(request.request_id, seed))
        except KvCapacityError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        self.requests.inc()
        result: dict = {}
        items = self._items(job, result)
        if request.kv_data_address:
            send = self.tcp_sender.send_items(request.kv_data_address, items)
        else:
            send = self.grpc_sender.send_items(request.decode_address, items)
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
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{KV_SEND_FAILED} {request.decode_address}: {exc}")
        finally:
            self.engine.release(job)
        return pb.PrefillResponse(first_token_id=result["first"], prefill_time_ms=result["prefill_ms"],
                                  kv_bytes=sent, kv_transfer_ms=(time.perf_counter() - start) * 1000)

    async def _items(self, job: SimPrefillJob, result: dict):
        """Header, each layer as the simulated forward finishes it, trailer."""
        yield header(job.request_id, self.shape.dtype, self.shape.num_layers, self.shape.tensor_shape(job.num_tokens))
        tensor_bytes = self.shape.tensor_bytes(job.num_tokens)
        while True:
            item = await job.events.get()
            if item[0] == "layer":
                yield synthetic_layer(item[1], tensor_bytes)
            else:
                result["first"], result["prefill_ms"] = item[1], item[2]
                yield make_trailer(item[1], item[2])
                return

    async def Health(self, request, context) -> pb.HealthResponse:
        budget = self.engine.admission.budget
        return pb.HealthResponse(
            role="prefill", model=SIMULATED_MODEL, num_running=self.engine.num_running,
            num_waiting=self.engine.admission.num_waiting + len(self.engine.scheduler.queue),
            kv_capacity_tokens=budget.capacity, kv_used_tokens=budget.used, num_kv_leases=len(self.engine.leases),
            queued_prompt_tokens=self.engine.num_queued_tokens, draining=self.gate.draining,
        )


class SimulatedDecodeServicer(GatedDecodeServicer):
    """Register a request, wait for its KV cache (or prefill it here), stream its synthetic tokens."""

    def __init__(self, engine: SimulatedDecodeEngine, kv_trans_timeout_s: float, kv_data_address: str,
                 metrics: WorkerMetrics, gate: DrainGate):
        super().__init__(kv_trans_timeout_s, kv_data_address, gate)
        self.engine = engine
        self.requests = add_request_counter(metrics)

    async def _decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        sampling = request.sampling
        try:
            handle = self.engine.register(request.request_id, request.prompt_len, sampling.max_tokens,
                                          request.max_seq_len,
                                          token_key(request.request_id, sampling.seed if sampling.has_seed else None))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        try:
            try:
                await self.engine.admit(handle)
            except KvCapacityError as exc:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            self.requests.inc()
            yield pb.DecodeEvent(accepted=pb.Accepted(kv_data_address=self.kv_data_address))
            if request.local_prefill:
                self.engine.prefill_locally(handle)
            await self.wait_for_kv(handle, request.request_id, context)
            while True:
                item = await handle.events.get()
                if isinstance(item, Exception):
                    await context.abort(grpc.StatusCode.DATA_LOSS, str(item))
                yield pb.DecodeEvent(token=item)
                if item.finish_reason:
                    return
        finally:
            self.engine.release(request.request_id)

    async def Health(self, request, context) -> pb.HealthResponse:
        engine = self.engine
        budget = engine.admission.budget
        return pb.HealthResponse(
            role="decode", model=SIMULATED_MODEL, num_running=engine.scheduler.num_running,
            num_waiting=engine.admission.num_waiting + engine.num_pending_kv + engine.scheduler.num_waiting
            + len(engine.local_prefills.queue),
            kv_capacity_tokens=budget.capacity, kv_used_tokens=budget.used, draining=self.gate.draining,
        )


async def serve_simulated(options: SimulatedOptions) -> None:
    """Serve until SIGTERM/SIGINT, then deregister, drain for up to `drain_seconds`, and stop."""
    # A worker listening on 0.0.0.0 must tell others an address they can dial.
    public_host = options.advertise_host or options.host
    server = grpc.aio.server(options=GRPC_OPTIONS)
    gate = DrainGate()
    closers = []
    if options.role == "prefill":
        engine = SimulatedPrefillEngine(options.cost, options.kv_shape.num_layers, options.kv_budget_tokens,
                                        options.max_prefill_tokens, options.max_prefill_batch_size, options.vocab_size)
        metrics = engine.metrics = WorkerMetrics("prefill", engine)
        grpc_sender = GrpcKvSender(chunk_bytes=options.kv_chunk_bytes, timeout_s=options.kv_lease_timeout_s)
        servicer = SimulatedPrefillServicer(engine, options.kv_shape, grpc_sender, TcpKvSender(options.kv_chunk_bytes),
                                            options.kv_lease_timeout_s, metrics, gate)
        pb_grpc.add_PrefillServiceServicer_to_server(servicer, server)
        closers.append(grpc_sender.close)
    elif options.role == "decode":
        engine = SimulatedDecodeEngine(options.cost, options.kv_budget_tokens, options.max_running,
                                       options.max_prefill_tokens, options.max_prefill_batch_size, options.vocab_size)
        metrics = engine.metrics = WorkerMetrics("decode", engine)

        def on_kv(kv):
            engine.on_kv(kv)
            metrics.kv_bytes.inc(kv.num_bytes)

        def on_failure(request_id: str, message: str):
            metrics.kv_failures.inc()
            engine.fail(request_id, message)

        kv_data_address = ""
        if options.kv_data_port >= 0:
            receiver = TcpKvReceiver(on_kv, on_failure, timeout_s=options.kv_trans_timeout_s, assembler=VerifyingKvSink)
            kv_data_address = f"{public_host}:{await receiver.start(options.host, options.kv_data_port)}"
            closers.append(receiver.stop)
        servicer = SimulatedDecodeServicer(engine, options.kv_trans_timeout_s, kv_data_address, metrics, gate)
        pb_grpc.add_DecodeServiceServicer_to_server(servicer, server)
        pb_grpc.add_KvReceiverServicer_to_server(KvReceiverServicer(on_kv, on_failure, assembler=VerifyingKvSink),
                                                 server)
    else:
        raise ValueError(f"role must be 'prefill' or 'decode', got {options.role!r}")
    engine.start()

    await serve_until_stopped(server, options, gate, metrics, public_host, closers, engine)
