"""The gRPC sender and receiver over a real loopback server: exact for every dtype; streams without
the request's transfer token refused."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from kv_transfer.base import KvTransferError
from kv_transfer.grpc_transport import GRPC_OPTIONS, GrpcKvSender, KvReceiverServicer
from kv_transfer.codec import encode_kv
from kv_transfer.sink import KvSink
from kv_transfer.transfer_tokens import KvTransferTokens
from proto import worker_pb2_grpc as pb_grpc
from tests.helpers import bits, make_kv


def with_token(kv, tokens: KvTransferTokens):
    """`kv` carrying a fresh token that `tokens` issued for its request, as a decode worker's `accepted` does."""
    return dataclasses.replace(kv, transfer_token=tokens.issue(kv.request_id))


@pytest.fixture
async def receiver():
    received, failures, tokens = [], [], KvTransferTokens()
    server = grpc.aio.server(options=GRPC_OPTIONS)
    pb_grpc.add_KvReceiverServicer_to_server(
        KvReceiverServicer(KvSink(received.append, lambda rid, msg: failures.append((rid, msg)), tokens)), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}", received, failures, tokens
    await server.stop(None)


async def push(address: str, kv, header_only: bool = False) -> None:
    messages = list(encode_kv(kv, 1024))
    async with grpc.aio.insecure_channel(address) as channel:
        await pb_grpc.KvReceiverStub(channel).PushKv(iter(messages[:1] if header_only else messages), timeout=10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
async def test_kv_sent_over_grpc_arrives_bit_exact(receiver, dtype):
    address, received, _, tokens = receiver
    kv = with_token(make_kv(dtype, layers=4, seq=300), tokens)
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

    tokens = KvTransferTokens()
    server = grpc.aio.server()
    pb_grpc.add_KvReceiverServicer_to_server(KvReceiverServicer(KvSink(on_kv, lambda *a: None, tokens)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    sender = GrpcKvSender()
    try:
        with pytest.raises(KvTransferError, match="DATA_LOSS: no decode request 'req-1' is waiting for a KV cache"):
            await sender.send(f"127.0.0.1:{port}", with_token(make_kv(torch.float32), tokens))
    finally:
        await sender.close()
        await server.stop(None)


@pytest.mark.parametrize("token", ["", "not-the-issued-token"])
async def test_grpc_stream_without_the_issued_token_is_denied_and_the_genuine_one_still_lands(receiver, token):
    address, received, failures, tokens = receiver
    genuine = with_token(make_kv(torch.float32), tokens)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        # The header alone, which is all the receiver reads before refusing: a client still writing blocks when the
        # refusal lands can see its stream reset (INTERNAL) before the status, on a loaded machine.
        await push(address, dataclasses.replace(genuine, transfer_token=token), header_only=True)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'req-1' refused: missing/invalid or already used transfer token" in err.value.details()
    assert received == [] and failures == []  # the request it named is not failed
    await push(address, genuine)
    assert len(received) == 1 and failures == []


async def test_grpc_stream_replaying_a_spent_token_is_denied_without_failing_the_request(receiver):
    address, received, failures, tokens = receiver
    kv = with_token(make_kv(torch.float32), tokens)
    await push(address, kv)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await push(address, kv, header_only=True)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "already used" in err.value.details()
    assert len(received) == 1 and failures == [] and len(tokens) == 0


async def test_grpc_header_refused_after_the_token_is_spent_fails_the_request(receiver):
    address, received, failures, tokens = receiver
    messages = list(encode_kv(with_token(make_kv(torch.float32), tokens), 1024))
    messages[0].header.tensor_bytes += 4
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.KvReceiverStub(channel).PushKv(iter(messages), timeout=10)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert received == [] and [rid for rid, _ in failures] == ["req-1"]
