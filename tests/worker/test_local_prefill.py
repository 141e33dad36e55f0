"""Conditional disaggregation: a real decode worker prefills `local_prefill` requests itself."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest
import torch

from kv_transfer.codec import encode_kv
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from tests.helpers import (GREEDY_PROMPTS, health, hf_prefill, metrics_url, reference_tokens, scrape, start_worker,
                           wait_for_idle, wait_until)

pytestmark = pytest.mark.system

MAX_SEQ_LEN = 512


@pytest.fixture(scope="module")
def decode_worker(model_dir):
    worker = start_worker("decode", model_dir, "--kv-budget-tokens", "4000", "--kv-trans-timeout", "3")
    yield worker
    worker.stop()


def greedy(max_tokens: int, **fields) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0, top_p=1, max_tokens=max_tokens, **fields)


async def read_tokens(call) -> list[pb.TokenEvent]:
    """The token events of an accepted Decode stream, up to its end."""
    assert (await call.read()).HasField("accepted")
    return await read_rest(call)


async def read_rest(call) -> list[pb.TokenEvent]:
    """The token events of a Decode stream whose `accepted` has been read, up to its end."""
    tokens = []
    while (event := await call.read()) is not grpc.aio.EOF:
        tokens.append(event.token)
    return tokens


def open_decode(channel, prompt_ids: list[int], sampling: pb.SamplingParams, local_prefill: bool = True,
                prompt_len: int | None = None, request_id: str | None = None):
    return pb_grpc.DecodeServiceStub(channel).Decode(pb.DecodeRequest(
        request_id=request_id or uuid.uuid4().hex, prompt_len=len(prompt_ids) if prompt_len is None else prompt_len,
        max_seq_len=MAX_SEQ_LEN, sampling=sampling, prompt_token_ids=prompt_ids, local_prefill=local_prefill),
        timeout=60)


def prompt_ids(hf_model, prompt: str) -> list[int]:
    return hf_model[1](prompt)["input_ids"]


@pytest.mark.parametrize("prompt", GREEDY_PROMPTS)
async def test_local_prefill_tokens_match_local_greedy_generate(decode_worker, hf_model, prompt):
    ids = prompt_ids(hf_model, prompt)
    async with grpc.aio.insecure_channel(decode_worker.address) as channel:
        tokens = await read_tokens(open_decode(channel, ids, greedy(10)))
    assert [t.token_id for t in tokens] == reference_tokens(hf_model, ids, 10)
    assert [t.index for t in tokens] == list(range(10))
    assert tokens[0].time_ms > 0 and tokens[-1].finish_reason == pb.FINISH_REASON_LENGTH
    wait_for_idle(decode_worker.address, "decode")


async def test_local_prefill_first_token_logprobs_are_the_models(decode_worker, hf_model):
    ids = prompt_ids(hf_model, "Hello there")
    async with grpc.aio.insecure_channel(decode_worker.address) as channel:
        tokens = await read_tokens(open_decode(channel, ids, greedy(2, return_logprobs=True, top_logprobs=3)))
    with torch.inference_mode():
        expected = torch.log_softmax(hf_model[0](torch.tensor([ids])).logits[0, -1].float(), dim=-1)
    first = tokens[0]
    assert first.logprob == pytest.approx(float(expected[first.token_id]), abs=1e-4)
    top = torch.topk(expected, 3)
    assert [t.token_id for t in first.top_logprobs] == top.indices.tolist()
    assert [t.logprob for t in first.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)


async def test_local_prefill_request_is_given_no_kv_transfer_token(decode_worker, hf_model):
    async with grpc.aio.insecure_channel(decode_worker.address) as channel:
        call = open_decode(channel, prompt_ids(hf_model, "Hello there"), greedy(2))
        accepted = (await call.read()).accepted
        assert accepted.kv_transfer_token == ""  # no KV stream is taken for a request prefilled here
        assert len(await read_rest(call)) == 2


async def test_concurrent_local_prefills_and_a_transferred_request_give_each_its_greedy_tokens(
        decode_worker, hf_model):
    max_tokens = 16
    all_ids = [prompt_ids(hf_model, p) for p in GREEDY_PROMPTS]
    transferred_ids = prompt_ids(hf_model, "A request whose KV cache came from a prefill worker")
    rid = uuid.uuid4().hex
    async with grpc.aio.insecure_channel(decode_worker.address) as channel:
        transferred = open_decode(channel, transferred_ids, greedy(max_tokens), local_prefill=False, request_id=rid)
        kv = hf_prefill(hf_model, rid, transferred_ids)
        kv.transfer_token = (await transferred.read()).accepted.kv_transfer_token
        transferred_tokens = asyncio.ensure_future(read_rest(transferred))
        local = [asyncio.ensure_future(read_tokens(open_decode(channel, ids, greedy(max_tokens)))) for ids in all_ids]

        async def locals_taken():  # the worker holds them all, prefilling or decoding (or they already ended)
            h = await asyncio.to_thread(health, decode_worker.address, "decode")
            return h.num_running + h.num_waiting >= 1 + len(local) or any(f.done() for f in local)

        await wait_until(locals_taken, what="the local requests to reach the worker")  # before the KV arrives
        await pb_grpc.KvReceiverStub(channel).PushKv(iter(encode_kv(kv)), timeout=30)
        results = await asyncio.gather(*local, transferred_tokens)
    for ids, tokens in zip(all_ids + [transferred_ids], results):
        assert [t.token_id for t in tokens] == reference_tokens(hf_model, ids, max_tokens)
    assert max(t.batch_size for tokens in results for t in tokens) > 1, "the requests never shared a decode step"
    h = wait_for_idle(decode_worker.address, "decode")
    assert h.kv_used_tokens == 0


async def test_seeded_sampling_with_local_prefill_equals_the_prefill_worker_path(cluster, hf_model):
    ids = prompt_ids(hf_model, "Once upon a time")
    sampling = pb.SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234, has_seed=True, max_tokens=12,
                                 ignore_eos=True)
    async with grpc.aio.insecure_channel(cluster.decode.address) as channel, \
            grpc.aio.insecure_channel(cluster.prefill.address) as prefill_channel:
        local = await read_tokens(open_decode(channel, ids, sampling))
        # This test plays the coordinator for the disaggregated path: Decode first, then Prefill.
        rid = uuid.uuid4().hex
        call = open_decode(channel, ids, sampling, local_prefill=False, request_id=rid)
        accepted = await call.read()
        await pb_grpc.PrefillServiceStub(prefill_channel).Prefill(pb.PrefillRequest(
            request_id=rid, prompt_token_ids=ids, sampling=sampling, decode_address=cluster.decode.address,
            kv_data_address=accepted.accepted.kv_data_address, kv_transfer_token=accepted.accepted.kv_transfer_token,
            kv_layout_version=accepted.accepted.kv_layout_version), timeout=30)
        remote = []
        while (event := await call.read()) is not grpc.aio.EOF:
            remote.append(event.token)
    assert [t.token_id for t in local] == [t.token_id for t in remote]
    assert len(local) == 12


def test_local_prefill_is_observed_as_a_prefill_step_in_the_workers_metrics(decode_worker, hf_model):
    url = metrics_url(decode_worker)
    key = ("pdserve_worker_step_duration_seconds_count", (("kind", "prefill"),))
    before = scrape(url).get(key, 0)

    async def run():
        async with grpc.aio.insecure_channel(decode_worker.address) as channel:
            return await read_tokens(open_decode(channel, prompt_ids(hf_model, "Hello there"), greedy(3)))

    assert len(asyncio.run(run())) == 3
    assert scrape(url)[key] == before + 1


@pytest.mark.parametrize("ids, prompt_len", [([], 5), ([11, 12, 13], 4)], ids=["empty", "short"])
async def test_local_prefill_without_the_whole_prompt_is_an_invalid_argument(decode_worker, ids, prompt_len):
    async with grpc.aio.insecure_channel(decode_worker.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await open_decode(channel, ids, greedy(4), prompt_len=prompt_len).read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "local_prefill needs the whole prompt" in err.value.details()
    wait_for_idle(decode_worker.address, "decode")


async def test_failed_local_prefill_fails_its_request_and_the_worker_keeps_serving(decode_worker, hf_model):
    out_of_vocab = hf_model[0].config.vocab_size + 7  # the embedding lookup raises inside the forward
    async with grpc.aio.insecure_channel(decode_worker.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await read_tokens(open_decode(channel, [5, out_of_vocab, 6], greedy(4)))
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "local prefill failed" in err.value.details()
        ids = prompt_ids(hf_model, "Hello there")
        tokens = await read_tokens(open_decode(channel, ids, greedy(4)))
    assert [t.token_id for t in tokens] == reference_tokens(hf_model, ids, 4)
    wait_for_idle(decode_worker.address, "decode")
