"""The gRPC sender and receiver over a real loopback server: exact for every dtype."""

from __future__ import annotations

import grpc
import pytest
import torch

from kv_transfer.base import KvTransferError
from kv_transfer.grpc_transport import GRPC_OPTIONS, GrpcKvSender, KvReceiverServicer
from kv_transfer.sink import KvSink
from proto import worker_pb2_grpc as pb_grpc
from tests.helpers import bits, make_kv


@pytest.fixture
async def receiver():
    received, failures = [], []
    server = grpc.aio.server(options=GRPC_OPTIONS)
    pb_grpc.add_KvReceiverServicer_to_server(
        KvReceiverServicer(KvSink(received.append, lambda rid, msg: failures.append((rid, msg)))), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}", received, failures
    await server.stop(None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
async def test_kv_sent_over_grpc_arrives_bit_exact(receiver, dtype):
    address, received, _ = receiver
    kv = make_kv(dtype, layers=4, seq=300)
    sender = GrpcKvSender(chunk_bytes=8192)
    try:
        assert await sender.send(address, kv) == kv.num_bytes
    finally:
        await sender.close()
    (out,) = received
    for (k0, v0), (k1, v1) in zip(kv.layers, out.layers):
        assert torch.equal(bits(k0), bits(k1)) and torch.equal(bits(v0), bits(v1))


async def test_rejected_kv_stream_fails_the_sender_with_the_reason():
    def on_kv(kv):
        raise KvTransferError("no decode request 'req-1' is waiting for a KV cache")

    server = grpc.aio.server()
    pb_grpc.add_KvReceiverServicer_to_server(KvReceiverServicer(KvSink(on_kv, lambda *a: None)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    sender = GrpcKvSender()
    try:
        with pytest.raises(KvTransferError, match="is waiting for a KV cache"):
            await sender.send(f"127.0.0.1:{port}", make_kv(torch.float32))
    finally:
        await sender.close()
        await server.stop(None)
