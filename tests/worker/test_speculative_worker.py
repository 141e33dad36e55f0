"""A real decode worker process drafting (`--speculative-method suffix`): the coordinator's hints and the client's
switch on the wire, its tokens against transformers' greedy ones, its spec_decode metrics."""

from __future__ import annotations

import uuid

import grpc
import pytest

from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from tests.helpers import metrics_url, reference_tokens, scrape, start_worker, wait_for_idle

pytestmark = pytest.mark.system

PROMPT = "The river ran past the mill and the mill ran with the river"
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def drafting_worker(model_dir):
    worker = start_worker("decode", model_dir, "--kv-budget-tokens", "4000", "--speculative-method", "suffix",
                          "--num-speculative-tokens", "6")
    yield worker
    worker.stop()


async def decode(address: str, ids: list[int], hints: list[list[int]] = (), no_drafts: bool = False) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.DecodeServiceStub(channel).Decode(pb.DecodeRequest(
            request_id=uuid.uuid4().hex, prompt_len=len(ids), max_seq_len=512, prompt_token_ids=ids,
            local_prefill=True, no_drafts=no_drafts, draft_hints=[pb.DraftHint(token_ids=h) for h in hints],
            sampling=pb.SamplingParams(temperature=0, top_p=1, max_tokens=NEW_TOKENS, ignore_eos=True)), timeout=60)
        assert (await call.read()).HasField("accepted")
        tokens = []
        while (event := await call.read()) is not grpc.aio.EOF:
            tokens.append(event.token.token_id)
        return tokens


def spec(url: str, name: str, **labels) -> float:
    return scrape(url).get((f"pdserve_worker_spec_decode_{name}_total", tuple(sorted(labels.items()))), 0.0)


async def test_hints_holding_the_answer_are_accepted_and_the_tokens_are_greedy_generates(drafting_worker, hf_model):
    ids = hf_model[1](PROMPT)["input_ids"]
    want = reference_tokens(hf_model, ids, NEW_TOKENS)
    url = metrics_url(drafting_worker)
    accepted = spec(url, "num_accepted_tokens")
    # An earlier answer to the same prompt, as the coordinator's corpus sends it, and a misleading one.
    assert await decode(drafting_worker.address, ids, hints=[want, want[::-1]]) == want
    drafts, gained = spec(url, "num_drafts"), spec(url, "num_accepted_tokens") - accepted
    assert gained >= NEW_TOKENS // 2 and spec(url, "num_accepted_tokens_per_pos", position="0") > 0
    assert gained / drafts > 1  # more than one token per verified step
    wait_for_idle(drafting_worker.address, "decode")


async def test_a_request_with_drafting_off_drafts_nothing_and_gets_the_same_tokens(drafting_worker, hf_model):
    ids = hf_model[1](PROMPT)["input_ids"]
    want = reference_tokens(hf_model, ids, NEW_TOKENS)
    url = metrics_url(drafting_worker)
    drafts, off = spec(url, "num_drafts"), spec(url, "skipped_rows", reason="request_off")
    assert await decode(drafting_worker.address, ids, hints=[want], no_drafts=True) == want
    assert spec(url, "num_drafts") == drafts
    assert spec(url, "skipped_rows", reason="request_off") - off >= NEW_TOKENS - 2


async def test_hints_past_the_wire_bounds_are_refused_by_name(drafting_worker):
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await decode(drafting_worker.address, [5, 6, 7], hints=[[1, 2]] * 17)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "draft_hints" in failure.value.details()


async def test_hints_naming_tokens_outside_the_vocabulary_are_dropped_not_drafted(drafting_worker, hf_model):
    ids = hf_model[1](PROMPT)["input_ids"]
    assert await decode(drafting_worker.address, ids, hints=[[10**6, 10**6 + 1, 5]]) == \
        reference_tokens(hf_model, ids, NEW_TOKENS)
