"""Guided decoding on the real engines, in-process: the embedded model's unconstrained output is gibberish, so
every output that parses is the masks' doing. Through local prefill and through a prefill engine's first token."""

from __future__ import annotations

import asyncio
import json
import re
import uuid

import jsonschema
import llguidance
import pytest
import torch

from kv_transfer.base import TransferredKv
from worker.torch_engine.build import paged_pool
from worker.torch_engine.decode_engine import DecodeEngine
from worker.engine.errors import InvalidRequest
from worker.engine.messages import KvLayerReady, PrefillDone
from worker.torch_engine.model_runner import ModelRunner
from worker.torch_engine.prefill_engine import PrefillEngine
from worker.engine.sequence import SamplingParams, StopCause, TokenOutput

pytestmark = pytest.mark.system  # about a minute of decoding on two cores

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
# As the coordinator builds it: JSON whitespace, but bounded runs of it.
JSON = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides={"whitespace_pattern": r"[ \n]{0,4}"})
COMPACT_JSON = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides={"whitespace_flexible": False})
REGEX = r"[A-Z][a-z]{2,6}-[0-9]{1,3}"
CHOICES = ("yes", "no", "maybe not")
LARK = 'start: greeting " " name "!"\ngreeting: "hello" | "hi"\nname: /[a-z]{1,8}/\n'
LARK_AS_REGEX = r"(hello|hi) [a-z]{1,8}!"
SAMPLINGS = {"greedy": {}, "seeded": {"temperature": 1.0, "seed": 11}, "top_k_p": {"temperature": 0.8, "seed": 5,
                                                                                  "top_k": 40, "top_p": 0.9}}


@pytest.fixture(scope="module")
async def engines(model_dir):
    prefill_runner, decode_runner = ModelRunner(model_dir), ModelRunner(model_dir)
    prefill = PrefillEngine(prefill_runner, paged_pool(prefill_runner, 10_000))
    decode = DecodeEngine(decode_runner, paged_pool(decode_runner, 10_000))
    prefill.start()
    decode.start()
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


@pytest.fixture(scope="module")
def prompt(engines) -> list[int]:
    return engines[1].runner.tokenizer("Answer in the required format:")["input_ids"]


def regex_grammar(regex: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(regex)


def lark_grammar(lark: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(lark)


async def read(decode: DecodeEngine, handle) -> list[TokenOutput]:
    outputs = []
    while True:
        item = await asyncio.wait_for(handle.events.get(), 60)
        if isinstance(item, Exception):
            raise item
        outputs.append(item)
        if item.finish_reason is not None:
            decode.release(handle.request_id)
            return outputs


async def generate_locally(engines, prompt: list[int], sampling: SamplingParams) -> list[TokenOutput]:
    """A decode engine that prefills the prompt itself (conditional disaggregation)."""
    _, decode = engines
    decode.check_sampling(sampling)
    handle = decode.register(uuid.uuid4().hex, len(prompt), sampling, 512, prompt)
    await decode.admit(handle)
    decode.prefill_locally(handle)
    return await read(decode, handle)


async def generate_disaggregated(engines, prompt: list[int], sampling: SamplingParams) -> list[TokenOutput]:
    """The prefill engine picks the first token and hands the KV over; the decode engine goes on."""
    prefill, decode = engines
    decode.check_sampling(sampling)
    rid = uuid.uuid4().hex
    handle = decode.register(rid, len(prompt), sampling, 512, prompt)
    await decode.admit(handle)
    job = await prefill.submit(rid, prompt, sampling)
    layers = {}
    while isinstance(event := await asyncio.wait_for(job.events.get(), 60), KvLayerReady):
        layers[event.layer.index] = (event.layer.key.clone(), event.layer.value.clone())
    prefill.release(job)
    assert isinstance(event, PrefillDone), event
    logprobs = (event.logprobs.logprob, event.logprobs.top) if event.logprobs else None
    decode.on_kv(TransferredKv(rid, [layers[i] for i in range(len(layers))], event.first_token_id,
                               event.prefill_ms, logprobs))
    return await read(decode, handle)


PATHS = {"local_prefill": generate_locally, "prefill_worker": generate_disaggregated}


def text(outputs: list[TokenOutput]) -> str:
    return "".join(o.text for o in outputs)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sampling", SAMPLINGS)
async def test_json_schema_output_validates(engines, prompt, path, sampling):
    outputs = await PATHS[path](engines, prompt, SamplingParams(max_tokens=200, grammar=JSON, **SAMPLINGS[sampling]))
    assert outputs[-1].finish_reason is StopCause.EOS, text(outputs)
    jsonschema.validate(json.loads(text(outputs)), SCHEMA)


@pytest.mark.parametrize("path", PATHS)
async def test_regex_output_fullmatches(engines, prompt, path):
    for sampling in SAMPLINGS.values():
        outputs = await PATHS[path](engines, prompt, SamplingParams(max_tokens=40, grammar=regex_grammar(REGEX),
                                                                    **sampling))
        assert re.fullmatch(REGEX, text(outputs)), text(outputs)


async def test_choice_output_is_one_of_the_choices(engines, prompt):
    grammar = lark_grammar("start: " + " | ".join(json.dumps(c) for c in CHOICES))
    seen = set()
    for seed in range(6):
        outputs = await generate_locally(engines, prompt, SamplingParams(max_tokens=20, grammar=grammar,
                                                                         temperature=1.0, seed=seed))
        assert text(outputs) in CHOICES
        seen.add(text(outputs))
    assert seen  # whichever the model prefers; all of them are inside


@pytest.mark.parametrize("path", PATHS)
async def test_lark_output_follows_the_grammar(engines, prompt, path):
    for sampling in SAMPLINGS.values():
        outputs = await PATHS[path](engines, prompt, SamplingParams(max_tokens=40, grammar=lark_grammar(LARK),
                                                                    **sampling))
        assert re.fullmatch(LARK_AS_REGEX, text(outputs)), text(outputs)


async def test_guided_and_unconstrained_requests_share_steps_and_each_keeps_its_own_rules(engines, prompt):
    alone = await generate_locally(engines, prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    requests = [SamplingParams(max_tokens=24, ignore_eos=True)] + [
        SamplingParams(max_tokens=200, grammar=COMPACT_JSON, temperature=1.0, seed=seed) for seed in range(4)]
    results = await asyncio.gather(*(generate_locally(engines, prompt, s) for s in requests))
    assert [o.token_id for o in results[0]] == [o.token_id for o in alone]  # unconstrained rows untouched
    assert max(o.batch_size for outputs in results for o in outputs) > 1, "the requests never shared a step"
    for outputs in results[1:]:  # n > 1: separate sequences, each with its own matcher
        jsonschema.validate(json.loads(text(outputs)), SCHEMA)


@pytest.mark.parametrize("path", PATHS)
async def test_a_moved_request_replays_its_tokens_and_greedy_continues_exactly(engines, prompt, path):
    whole = await generate_locally(engines, prompt, SamplingParams(max_tokens=200, grammar=JSON))
    tokens = [o.token_id for o in whole]
    for cut in (1, len(tokens) // 2, len(tokens) - 2):
        # As the coordinator continues a request on another worker: the tokens so far join the prompt and
        # are replayed into the grammar; the new worker's first token is masked from where they left it.
        sampling = SamplingParams(max_tokens=200 - cut, grammar=JSON, grammar_generated=tuple(tokens[:cut]))
        rest = await PATHS[path](engines, prompt + tokens[:cut], sampling)
        assert [o.token_id for o in rest] == tokens[cut:], f"cut at {cut}"
    jsonschema.validate(json.loads(text(whole)), SCHEMA)


async def test_a_moved_request_sampled_with_a_seed_stays_inside_its_grammar(engines, prompt):
    whole = await generate_locally(engines, prompt, SamplingParams(max_tokens=200, grammar=COMPACT_JSON,
                                                                   temperature=1.0, seed=3))
    cut = len(whole) // 2
    head = [o.token_id for o in whole[:cut]]
    sampling = SamplingParams(max_tokens=200, grammar=COMPACT_JSON, grammar_generated=tuple(head), temperature=1.0,
                              seed=99)
    rest = await generate_disaggregated(engines, prompt + head, sampling)
    jsonschema.validate(json.loads(text(whole[:cut]) + text(rest)), SCHEMA)


@pytest.mark.parametrize("path", PATHS)
async def test_logprobs_of_guided_tokens_are_the_raw_distributions(engines, prompt, path, hf_model):
    outputs = await PATHS[path](engines, prompt, SamplingParams(max_tokens=3, grammar=JSON, return_logprobs=True,
                                                                top_logprobs=4))
    model = hf_model[0]
    ids = list(prompt)
    for output in outputs:
        with torch.inference_mode():
            expected = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        assert output.logprobs.logprob == pytest.approx(float(expected[output.token_id]), abs=1e-3)
        assert [t for t, _ in output.logprobs.top] == torch.topk(expected, 4).indices.tolist()
        ids.append(output.token_id)
    assert outputs[0].logprobs.logprob < -0.5  # the masked distribution would have made "{" nearly certain


@pytest.mark.parametrize("path", PATHS)
async def test_logit_bias_plus_100_forces_a_token_and_minus_100_bans_one(engines, prompt, path):
    greedy = await PATHS[path](engines, prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    favourite = greedy[0].token_id
    forced = 40 if favourite != 40 else 41
    outputs = await PATHS[path](engines, prompt, SamplingParams(max_tokens=8, ignore_eos=True,
                                                                logit_bias=((forced, 100.0),)))
    assert [o.token_id for o in outputs] == [forced] * 8
    banned = {o.token_id for o in greedy}
    outputs = await PATHS[path](engines, prompt, SamplingParams(
        max_tokens=8, ignore_eos=True, temperature=1.0, seed=2, logit_bias=tuple((t, -100.0) for t in sorted(banned))))
    assert not banned & {o.token_id for o in outputs}


async def test_min_tokens_gives_way_to_a_grammar_that_allows_only_eos(engines, prompt):
    outputs = await generate_locally(engines, prompt, SamplingParams(max_tokens=40, min_tokens=30,
                                                                     grammar=lark_grammar('start: "ok"')))
    assert text(outputs) == "ok" and outputs[-1].finish_reason is StopCause.EOS


@pytest.mark.parametrize("path", PATHS)
async def test_a_finished_grammar_ends_the_request_even_with_ignore_eos(engines, prompt, path):
    outputs = await PATHS[path](engines, prompt, SamplingParams(max_tokens=40, ignore_eos=True,
                                                                grammar=lark_grammar('start: "done"')))
    assert text(outputs) == "done" and outputs[-1].finish_reason is StopCause.EOS



async def test_a_matcher_failing_mid_stream_fails_only_its_request_as_invalid(engines, prompt, monkeypatch):
    decode = engines[1]
    doomed, steps = [], []
    make_matcher, consume = decode.guidance.matcher, decode.guidance.masks.consume

    def matcher(sampling):
        made = make_matcher(sampling)
        if sampling.seed == 404:
            doomed.append(made)
        return made

    def consume_until_the_fifth_step(matchers, tokens):
        # As if the doomed grammar ran out of lexer fuel on its fifth token.
        steps.extend(m for m in matchers if m in doomed)
        return [ok and not (m in doomed and len(steps) >= 5) for m, ok in zip(matchers, consume(matchers, tokens))]

    monkeypatch.setattr(decode.guidance, "matcher", matcher)
    monkeypatch.setattr(decode.guidance.masks, "consume", consume_until_the_fifth_step)
    healthy = asyncio.ensure_future(generate_locally(engines, prompt, SamplingParams(max_tokens=200,
                                                                                     grammar=COMPACT_JSON)))
    with pytest.raises(InvalidRequest, match="guided decoding failed on the worker"):
        await generate_locally(engines, prompt, SamplingParams(max_tokens=200, grammar=COMPACT_JSON, temperature=1.0,
                                                               seed=404))
    jsonschema.validate(json.loads(text(await healthy)), SCHEMA)
