"""The Decode RPC's shell, shared by real and simulated decode workers: the drain gate, the
request checks, and the wait for the KV cache. Subclasses implement `_decode`."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from worker.drain import DrainGate, refuse_if_draining


class GatedDecodeServicer(pb_grpc.DecodeServiceServicer):
    """Refuses new streams while draining, counts running ones, checks each request once."""

    def __init__(self, kv_trans_timeout_s: float, kv_data_address: str, gate: DrainGate):
        self.kv_trans_timeout_s = kv_trans_timeout_s
        self.kv_data_address = kv_data_address
        self.gate = gate

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        await refuse_if_draining(self.gate, context)
        if request.prompt_len <= 0 or request.prompt_len >= request.max_seq_len:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt_len={request.prompt_len} must be in [1, max_seq_len={request.max_seq_len})",
            )
        if request.local_prefill and len(request.prompt_token_ids) != request.prompt_len:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"local_prefill needs the whole prompt: got {len(request.prompt_token_ids)} prompt_token_ids "
                f"for prompt_len={request.prompt_len}",
            )
        with self.gate.request():
            # aclosing: a stream ended early still runs _decode's cleanup now, not at garbage collection.
            async with contextlib.aclosing(self._decode(request, context)) as events:
                async for event in events:
                    yield event

    async def _decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        raise NotImplementedError
        yield  # pragma: no cover - makes this an async generator

    async def wait_for_kv(self, handle, request_id: str, context: grpc.aio.ServicerContext) -> None:
        """Wait for the request's KV cache; abort with DEADLINE_EXCEEDED if nothing came in time."""
        try:
            await asyncio.wait_for(handle.kv_arrived.wait(), self.kv_trans_timeout_s)
        except asyncio.TimeoutError:
            if handle.events.empty():
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"KV cache for request {request_id} did not arrive within "
                    f"kv_trans_timeout={self.kv_trans_timeout_s}s",
                )
