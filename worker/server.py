"""The worker process: a thin grpc.aio servicer over the prefill or decode engine."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc

from kv_transfer.base import KvTransferError
from kv_transfer.grpc_transport import GRPC_OPTIONS, GrpcKvSender, KvReceiverServicer
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from worker.engine import DecodeEngine, PrefillEngine
from worker.model_runner import ModelRunner
from worker.sequence import FinishReason, SamplingParams, TokenOutput

logger = logging.getLogger(__name__)

_FINISH_TO_PB = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP_STRING: pb.FINISH_REASON_STOP_STRING,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
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
    kv_chunk_bytes: int = 4 * 1024 * 1024


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.has_seed else None,
        max_tokens=msg.max_tokens,
        stop=tuple(msg.stop),
        skip_special_tokens=msg.skip_special_tokens,
    )


def token_to_pb(output: TokenOutput) -> pb.DecodeEvent:
    return pb.DecodeEvent(
        token=pb.TokenEvent(
            token_id=output.token_id,
            text=output.text,
            time_ms=output.time_ms,
            finish_reason=_FINISH_TO_PB[output.finish_reason],
            index=output.index,
            matched_stop=output.matched_stop or "",
        )
    )


class PrefillServicer(pb_grpc.PrefillServiceServicer):
    """Prefill, then push the KV cache to the decode worker the coordinator chose."""

    def __init__(self, engine: PrefillEngine, sender: GrpcKvSender):
        self.engine = engine
        self.sender = sender

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        if not request.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids is empty")
        kv = await self.engine.prefill(
            request.request_id, list(request.prompt_token_ids), sampling_from_pb(request.sampling)
        )
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            sent = await self.sender.send(request.decode_address, kv)
        except KvTransferError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return pb.PrefillResponse(
            first_token_id=kv.first_token_id,
            prefill_time_ms=kv.prefill_time_ms,
            kv_bytes=sent,
            kv_transfer_ms=(loop.time() - start) * 1000,
        )

    async def Health(self, request, context) -> pb.HealthResponse:
        return pb.HealthResponse(role="prefill", model=str(self.engine.runner.model_dir), num_waiting=self.engine.num_queued)


class DecodeServicer(pb_grpc.DecodeServiceServicer):
    """Register a request, wait for its KV cache, stream its tokens."""

    def __init__(self, engine: DecodeEngine, kv_trans_timeout_s: float):
        self.engine = engine
        self.kv_trans_timeout_s = kv_trans_timeout_s

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        sampling = sampling_from_pb(request.sampling)
        if request.prompt_len <= 0 or request.prompt_len >= request.max_seq_len:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt_len={request.prompt_len} must be in [1, max_seq_len={request.max_seq_len})",
            )
        try:
            handle = self.engine.register(request.request_id, request.prompt_len, sampling, request.max_seq_len)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        try:
            yield pb.DecodeEvent(accepted=pb.Accepted())
            try:
                await asyncio.wait_for(handle.kv_arrived.wait(), self.kv_trans_timeout_s)
            except asyncio.TimeoutError:
                if handle.events.empty():
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"KV cache for request {request.request_id} did not arrive within "
                        f"kv_trans_timeout={self.kv_trans_timeout_s}s",
                    )
            while True:
                item = await handle.events.get()
                if isinstance(item, Exception):
                    await context.abort(grpc.StatusCode.DATA_LOSS, str(item))
                yield token_to_pb(item)
                if item.finish_reason is not None:
                    return
        finally:
            self.engine.release(request.request_id)

    async def Health(self, request, context) -> pb.HealthResponse:
        return pb.HealthResponse(
            role="decode",
            model=str(self.engine.runner.model_dir),
            num_running=self.engine.scheduler.num_running,
            num_waiting=self.engine.num_pending + self.engine.scheduler.num_waiting,
        )


async def serve(options: WorkerOptions) -> None:
    """Load the model, serve until SIGTERM/SIGINT, then stop gracefully."""
    runner = ModelRunner(options.model_dir, options.dtype)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    closers = []
    if options.role == "prefill":
        engine = PrefillEngine(runner)
        sender = GrpcKvSender(chunk_bytes=options.kv_chunk_bytes)
        pb_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(engine, sender), server)
        closers.append(sender.close)
    elif options.role == "decode":
        engine = DecodeEngine(runner)
        engine.start()
        pb_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(engine, options.kv_trans_timeout_s), server)
        pb_grpc.add_KvReceiverServicer_to_server(KvReceiverServicer(engine.on_kv, engine.fail), server)
    else:
        raise ValueError(f"role must be 'prefill' or 'decode', got {options.role!r}")

    port = server.add_insecure_port(f"{options.host}:{options.port}")
    if port == 0:
        raise OSError(f"cannot listen on {options.host}:{options.port}")
    await server.start()
    # One parseable line on stdout: launchers and tests read the bound port from it.
    print(f"pdserve worker ready: role={options.role} address={options.host}:{port}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("stopping %s worker on port %d", options.role, port)
    await server.stop(grace=5)
    for close in closers:
        await close()
    engine.shutdown()
