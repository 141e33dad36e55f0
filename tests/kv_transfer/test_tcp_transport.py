"""The raw-TCP KV path: exact for every dtype; corrupt, truncated and foreign streams refused."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import pytest
import torch

from kv_transfer.base import KvTransferError
from kv_transfer.codec import KvAssembler, KvLayer, checksum, kv_items, tensor_bytes
from kv_transfer.tcp_transport import ACK, BLOCK, DIGEST, LENGTH, PREAMBLE, TcpKvReceiver, TcpKvSender
from kv_transfer.sink import KvSink
from kv_transfer.transfer_tokens import KvTransferTokens
from tests.helpers import bits, landed_bytes, make_kv, scattered_landing


def with_token(kv, tokens: KvTransferTokens):
    """`kv` carrying a fresh token that `tokens` issued for its request, as a decode worker's `accepted` does."""
    return dataclasses.replace(kv, transfer_token=tokens.issue(kv.request_id))


@pytest.fixture
async def receiver():
    received, failures, tokens = [], [], KvTransferTokens()
    rx = TcpKvReceiver(KvSink(received.append, lambda rid, msg: failures.append((rid, msg)), tokens), timeout_s=5)
    port = await rx.start("127.0.0.1", 0)
    yield f"127.0.0.1:{port}", received, failures, tokens
    await rx.stop()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
async def test_kv_sent_over_tcp_arrives_bit_exact(receiver, dtype):
    address, received, _, tokens = receiver
    kv = with_token(make_kv(dtype, layers=4, seq=300), tokens)
    assert await TcpKvSender(chunk_bytes=8192).send(address, kv) == kv.num_bytes
    (out,) = received
    assert out.first_token_id == 42 and out.prefill_time_ms == 1.5
    for (k0, v0), (k1, v1) in zip(kv.layers, out.layers):
        assert torch.equal(bits(k0), bits(k1)) and torch.equal(bits(v0), bits(v1))


async def test_kv_sent_over_tcp_lands_in_scattered_pool_blocks_exact():
    received, failures, tokens, landings = [], [], KvTransferTokens(), []

    def land(header):
        landings.append(scattered_landing(header)[0])
        return landings[-1]

    sink = KvSink(received.append, lambda rid, msg: failures.append(msg), tokens,
                  assembler=lambda header, max_bytes, pool: KvAssembler(header, max_bytes, pool, land))
    rx = TcpKvReceiver(sink, timeout_s=5)
    port = await rx.start("127.0.0.1", 0)
    kv = with_token(make_kv(torch.float32, layers=2, seq=37), tokens)
    try:  # 1000-byte blocks over 640-byte runs: most blocks are received into two pieces
        assert await TcpKvSender(chunk_bytes=1000).send(f"127.0.0.1:{port}", kv) == kv.num_bytes
    finally:
        await rx.stop()
    (out,) = received
    assert failures == [] and out.landed is landings[0] and out.layers == []
    for i, (k, v) in enumerate(kv.layers):
        assert landed_bytes(out.landed, 2 * i) == bytes(tensor_bytes(k))
        assert landed_bytes(out.landed, 2 * i + 1) == bytes(tensor_bytes(v))


async def send_raw(address: str, frames: list[bytes]) -> tuple[int, str]:
    """Send hand-made frames; return the receiver's status and message."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    for frame in frames:
        writer.write(frame)
    await writer.drain()
    writer.write_eof()
    status, _, length = ACK.unpack(await reader.readexactly(ACK.size))
    message = (await reader.readexactly(length)).decode()
    writer.close()
    return status, message


def frames_for(kv, corrupt_block: int | None = None, drop_last_blocks: int = 0, chunk: int = 1024) -> list[bytes]:
    frames = [PREAMBLE]
    for item in kv_items(kv):
        if isinstance(item, KvLayer):
            for is_value, tensor in ((False, item.key), (True, item.value)):
                raw = tensor_bytes(tensor)
                for offset in range(0, len(raw), chunk):
                    data = bytes(raw[offset: offset + chunk])
                    digest = checksum(data)
                    if corrupt_block is not None and len(frames) == corrupt_block:
                        data = bytes([data[0] ^ 0xFF]) + data[1:]
                    frames.append(b"B" + BLOCK.pack(item.index, int(is_value), offset, len(data)) + data
                                  + DIGEST.pack(digest))
        else:
            body = item.SerializeToString()
            kind = b"H" if len(frames) == 1 else b"T"
            frames.append(kind + LENGTH.pack(len(body)) + body)
    if drop_last_blocks:
        frames = frames[: -1 - drop_last_blocks] + frames[-1:]
    return frames


async def test_flipped_byte_over_tcp_is_refused_and_reported(receiver):
    address, received, failures, tokens = receiver
    status, message = await send_raw(address, frames_for(with_token(make_kv(torch.float32), tokens), corrupt_block=5))
    assert status == 1 and "checksum mismatch" in message
    assert received == [] and failures == [("req-1", message)]


async def test_truncated_tcp_stream_is_refused(receiver):
    address, received, failures, tokens = receiver
    kv = with_token(make_kv(torch.float16), tokens)
    status, message = await send_raw(address, frames_for(kv, drop_last_blocks=2))
    assert status == 1 and "truncated" in message and received == []


async def test_foreign_bytes_are_refused(receiver):
    address, *_ = receiver
    status, message = await send_raw(address, [b"GET / HTTP/1.1\r\n\r\n"])
    assert status == 1 and "bad preamble" in message


async def test_refusal_by_the_engine_reaches_the_sender():
    def on_kv(kv):
        raise KvTransferError("no decode request 'req-1' is waiting for a KV cache")

    tokens = KvTransferTokens()
    rx = TcpKvReceiver(KvSink(on_kv, lambda *a: None, tokens))
    port = await rx.start("127.0.0.1", 0)
    try:
        with pytest.raises(KvTransferError, match="refused: no decode request"):
            await TcpKvSender().send(f"127.0.0.1:{port}", with_token(make_kv(torch.float32), tokens))
    finally:
        await rx.stop()


async def test_sender_to_a_closed_port_fails_clearly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(KvTransferError, match=f"KV transfer to 127.0.0.1:{port} failed"):
        await TcpKvSender().send(f"127.0.0.1:{port}", make_kv(torch.float32))


async def test_stalled_sender_times_out_on_the_receiver():
    failures, tokens = [], KvTransferTokens()
    rx = TcpKvReceiver(KvSink(lambda kv: None, lambda rid, msg: failures.append(rid), tokens), timeout_s=0.5)
    port = await rx.start("127.0.0.1", 0)
    try:
        frames = frames_for(with_token(make_kv(torch.float32), tokens))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"".join(frames[:3]))  # header and one block, then silence
        await writer.drain()
        status, _, length = ACK.unpack(await asyncio.wait_for(reader.readexactly(ACK.size), 5))
        assert status == 1 and failures == ["req-1"]
        writer.close()
    finally:
        await rx.stop()




@pytest.mark.parametrize("token", ["", "not-the-issued-token"])
async def test_tcp_stream_without_the_issued_token_is_refused_and_the_genuine_one_still_lands(receiver, token):
    address, received, failures, tokens = receiver
    genuine = with_token(make_kv(torch.float32), tokens)
    status, message = await send_raw(address, frames_for(dataclasses.replace(genuine, transfer_token=token)))
    assert status == 1 and "'req-1' refused: missing/invalid or already used transfer token" in message
    assert received == [] and failures == []  # the request it named is not failed
    assert await TcpKvSender().send(address, genuine) == genuine.num_bytes
    assert len(received) == 1 and failures == []


async def test_tcp_stream_replaying_a_spent_token_is_refused_without_failing_the_request(receiver):
    address, received, failures, tokens = receiver
    kv = with_token(make_kv(torch.float32), tokens)
    await TcpKvSender().send(address, kv)
    with pytest.raises(KvTransferError, match="refused: .*already used transfer token"):
        await TcpKvSender().send(address, kv)
    assert len(received) == 1 and failures == [] and len(tokens) == 0


async def test_a_header_length_beyond_the_bound_is_refused_before_allocating(receiver):
    address, received, failures, _ = receiver
    status, message = await send_raw(address, [PREAMBLE, b"H" + LENGTH.pack(1 << 30)])
    assert status == 1 and "exceeds" in message
    assert received == [] and failures == []


async def test_peers_that_connect_and_stall_do_not_hold_up_a_genuine_transfer(receiver):
    address, received, _, tokens = receiver
    host, port = address.rsplit(":", 1)
    stalled = [await asyncio.open_connection(host, int(port)) for _ in range(16)]  # more than the default executor
    try:
        kv = with_token(make_kv(torch.float16, layers=2, seq=64), tokens)
        assert await asyncio.wait_for(TcpKvSender().send(address, kv), 5) == kv.num_bytes
        assert len(received) == 1
    finally:
        for _, writer in stalled:
            writer.close()


async def test_a_refused_large_stream_still_tells_the_sender_why(receiver):
    address, received, failures, _ = receiver
    kv = dataclasses.replace(make_kv(torch.float32, layers=8, seq=8192), transfer_token="forged")  # ~32 MiB
    with pytest.raises(KvTransferError, match="transfer token"):  # not a broken pipe
        await TcpKvSender().send(address, kv)
    assert received == [] and failures == []
