"""A decode worker's prefix cache on the wire: `accepted` names the leading positions it holds, and the KV stream
carries only the rest (a real decode worker, this test standing in for the coordinator and the prefill worker)."""

from __future__ import annotations

import random
import uuid

import grpc
import pytest

from kv_transfer.codec import encode_kv
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from tests.helpers import fake_prompt_kv, health

pytestmark = pytest.mark.system


def decode_call(channel, rid: str, prompt: list[int]):
    return pb_grpc.DecodeServiceStub(channel).Decode(pb.DecodeRequest(
        request_id=rid, prompt_len=len(prompt), prompt_token_ids=prompt, max_seq_len=512,
        sampling=pb.SamplingParams(temperature=0, top_p=1, max_tokens=3)), timeout=30)


async def push_and_read(channel, call, kv) -> list:
    await pb_grpc.KvReceiverStub(channel).PushKv(iter(list(encode_kv(kv))), timeout=30)
    events = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        events.append(msg)
    return events


def tail_kv(rid: str, hf_model, prompt_len: int, first_position: int, token: str):
    kv = fake_prompt_kv(rid, hf_model, prompt_len - first_position)
    kv.first_position, kv.transfer_token = first_position, token
    return kv


async def test_a_prompt_seen_before_is_accepted_with_its_cached_blocks_and_only_the_rest_is_sent(cluster, hf_model):
    prompt = [random.Random(uuid.uuid4().int).randrange(3, 1000) for _ in range(40)]
    hits_before = health(cluster.decode.address, "decode").prefix_hit_tokens
    async with grpc.aio.insecure_channel(cluster.decode.address) as channel:
        rid = uuid.uuid4().hex
        call = decode_call(channel, rid, prompt)
        accepted = (await call.read()).accepted
        assert accepted.cached_tokens == 0  # never seen
        events = await push_and_read(channel, call, tail_kv(rid, hf_model, 40, 0, accepted.kv_transfer_token))
        assert len(events) == 3

        rid = uuid.uuid4().hex
        call = decode_call(channel, rid, prompt)
        accepted = (await call.read()).accepted
        assert accepted.cached_tokens == 32  # two full blocks of 16 stayed cached when the first request ended
        events = await push_and_read(channel, call, tail_kv(rid, hf_model, 40, 32, accepted.kv_transfer_token))
        assert [e.token.index for e in events] == [0, 1, 2]
    assert health(cluster.decode.address, "decode").prefix_hit_tokens - hits_before == 32


async def test_a_kv_stream_that_does_not_start_where_the_cached_prefix_ends_is_refused(cluster, hf_model):
    prompt = [random.Random(uuid.uuid4().int).randrange(3, 1000) for _ in range(40)]
    async with grpc.aio.insecure_channel(cluster.decode.address) as channel:
        rid = uuid.uuid4().hex
        call = decode_call(channel, rid, prompt)
        accepted = (await call.read()).accepted
        await push_and_read(channel, call, tail_kv(rid, hf_model, 40, 0, accepted.kv_transfer_token))
        rid = uuid.uuid4().hex
        call = decode_call(channel, rid, prompt)
        accepted = (await call.read()).accepted
        assert accepted.cached_tokens == 32
        whole = tail_kv(rid, hf_model, 40, 0, accepted.kv_transfer_token)  # resends what the worker holds
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await push_and_read(channel, call, whole)
        assert "starts at position 0 but this worker holds the prompt's first 32 positions" in err.value.details()
