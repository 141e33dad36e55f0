"""A real decode worker fed bad KV streams by this test acting as the prefill worker."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import pytest

from kv_transfer.codec import encode_kv, kv_items
from kv_transfer.tcp_transport import TcpKvSender
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from proto.failure_reason import reason_from_metadata
from tests.helpers import CLUSTER_KV_TIMEOUT_S, fake_prompt_kv

pytestmark = pytest.mark.system

PROMPT_LEN = 9


@pytest.fixture
async def decode_channel(cluster):
    async with grpc.aio.insecure_channel(cluster.decode.address) as channel:
        yield channel


async def open_decode(channel, request_id: str, max_tokens: int = 4):
    """An accepted Decode call and the one-time token its KV stream must carry."""
    call = pb_grpc.DecodeServiceStub(channel).Decode(pb.DecodeRequest(
        request_id=request_id, prompt_len=PROMPT_LEN, max_seq_len=512,
        sampling=pb.SamplingParams(temperature=0, top_p=1, max_tokens=max_tokens, skip_special_tokens=True),
    ), timeout=30)
    first = await call.read()
    assert first.HasField("accepted") and first.accepted.kv_transfer_token
    return call, first.accepted.kv_transfer_token


async def push(channel, messages):
    return await pb_grpc.KvReceiverStub(channel).PushKv(iter(messages), timeout=30)


async def read_all(call) -> list:
    events = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        events.append(msg)
    return events


async def test_valid_kv_stream_is_decoded_to_the_end(decode_channel, hf_model):
    rid = uuid.uuid4().hex
    call, token = await open_decode(decode_channel, rid, max_tokens=4)
    kv = fake_prompt_kv(rid, hf_model, PROMPT_LEN)
    kv.transfer_token = token
    ack = await push(decode_channel, list(encode_kv(kv)))
    assert ack.bytes_received > 0
    events = await read_all(call)
    assert [e.token.index for e in events] == [0, 1, 2, 3]
    assert events[0].token.token_id == 5
    assert events[-1].token.finish_reason == pb.FINISH_REASON_LENGTH


def corrupt_one_block(messages: list) -> list:
    messages[3].block.data = b"\x00" + messages[3].block.data[1:]
    return messages


def drop_the_last_blocks(messages: list) -> list:
    return messages[:-2]


@pytest.mark.parametrize(("damage", "needle"), [(corrupt_one_block, "checksum mismatch"),
                                                 (drop_the_last_blocks, "truncated")])
async def test_damaged_kv_stream_fails_transfer_and_decode_with_data_loss(decode_channel, hf_model, damage, needle):
    rid = uuid.uuid4().hex
    call, token = await open_decode(decode_channel, rid)
    kv = fake_prompt_kv(rid, hf_model, PROMPT_LEN)
    kv.transfer_token = token
    messages = damage(list(encode_kv(kv, chunk_bytes=512)))
    with pytest.raises(grpc.aio.AioRpcError) as push_err:
        await push(decode_channel, messages)
    assert push_err.value.code() == grpc.StatusCode.DATA_LOSS
    assert needle in push_err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as decode_err:
        await read_all(call)
    assert decode_err.value.code() == grpc.StatusCode.DATA_LOSS
    assert needle in decode_err.value.details()
    assert reason_from_metadata(decode_err.value.trailing_metadata()) == pb.FAILURE_REASON_KV_CORRUPT


async def test_kv_with_wrong_prompt_length_is_refused(decode_channel, hf_model):
    rid = uuid.uuid4().hex
    call, token = await open_decode(decode_channel, rid)
    kv = fake_prompt_kv(rid, hf_model, PROMPT_LEN)
    kv.transfer_token = token
    kv.layers = [(k[:-1], v[:-1]) for k, v in kv.layers]
    with pytest.raises(grpc.aio.AioRpcError) as push_err:
        await push(decode_channel, list(encode_kv(kv)))
    assert "prompt has 9 tokens" in push_err.value.details()
    with pytest.raises(grpc.aio.AioRpcError):
        await read_all(call)


async def test_kv_for_an_unknown_request_is_refused_as_it_has_no_transfer_token(decode_channel, hf_model):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await push(decode_channel, list(encode_kv(fake_prompt_kv("nobody-waits", hf_model, PROMPT_LEN))))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'nobody-waits' refused: missing/invalid or already used transfer token" in err.value.details()


async def test_a_decode_request_waits_for_a_transfer_that_never_starts_until_its_own_deadline(decode_channel):
    # A busy prefill worker may take long to start sending: only the coordinator's deadline (the call's) bounds that.
    deadline_s = CLUSTER_KV_TIMEOUT_S + 2
    started = time.monotonic()
    call = pb_grpc.DecodeServiceStub(decode_channel).Decode(pb.DecodeRequest(
        request_id=uuid.uuid4().hex, prompt_len=PROMPT_LEN, max_seq_len=512,
        sampling=pb.SamplingParams(temperature=0, top_p=1, max_tokens=4)), timeout=deadline_s)
    assert (await call.read()).HasField("accepted")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await read_all(call)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started >= deadline_s - 0.5  # not cut at kv_trans_timeout


async def test_a_started_kv_transfer_that_stalls_fails_after_kv_trans_timeout(decode_channel, hf_model):
    rid = uuid.uuid4().hex
    call = pb_grpc.DecodeServiceStub(decode_channel).Decode(pb.DecodeRequest(
        request_id=rid, prompt_len=PROMPT_LEN, max_seq_len=512,
        sampling=pb.SamplingParams(temperature=0, top_p=1, max_tokens=4)), timeout=30)
    accepted = (await call.read()).accepted
    kv = fake_prompt_kv(rid, hf_model, PROMPT_LEN)
    kv.transfer_token = accepted.kv_transfer_token
    stalled = asyncio.Event()

    async def header_then_silence():
        yield next(kv_items(kv))  # the header: the transfer has started
        stalled.set()
        await asyncio.sleep(60)

    sender = asyncio.create_task(TcpKvSender().send_items(accepted.kv_data_address, header_then_silence()))
    try:
        await stalled.wait()
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await read_all(call)
        assert err.value.code() == grpc.StatusCode.DATA_LOSS
        assert f"nothing arrived for {CLUSTER_KV_TIMEOUT_S}s" in err.value.details()
        assert time.monotonic() - started < CLUSTER_KV_TIMEOUT_S + 5
    finally:
        sender.cancel()


def test_cluster_still_serves_after_kv_faults(http):
    resp = http.post("/v1/completions", json={"model": "pdserve-tiny", "prompt": "Hello", "max_tokens": 3})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3
