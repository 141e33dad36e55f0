"""Speculative decoding in the real decode engine (in-process, embedded model): drafts verified in one forward give
exactly the tokens decoding without drafts gives, greedy or seeded, whatever is accepted."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from adapters.peft_folder import read_adapter
from tests.helpers import hf_prefill
from worker.engine.lora import AdapterRef, LoadedLora
from worker.engine.sequence import SamplingParams
from worker.engine.speculative.config import SpeculativeConfig
from worker.engine.speculative.drafter import Drafter
from worker.torch_engine.build import paged_pool
from worker.torch_engine.decode_engine import DecodeEngine
from worker.torch_engine.model_runner import ModelRunner

# Prompts that repeat themselves, so that n-gram and suffix drafts find matches.
PROMPTS = [[(7 * i + 3 * t) % 40 + 5 for t in range(24)] * 3 for i in range(4)]


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    return ModelRunner(model_dir)


class OracleProposer:
    """Drafts what the reference output continues with (all accepted), or a wrong token at every `wrong`-th draft."""

    def __init__(self, references: list[list[int]], wrong: int = 0):
        self.references, self.wrong, self.calls = [np.array(r) for r in references], wrong, 0

    def propose(self, text, hints, k):
        self.calls += 1
        for ref in self.references:
            if len(ref) > len(text) and np.array_equal(ref[: len(text)], text):
                draft = ref[len(text) : len(text) + k].tolist()
                if self.wrong and self.calls % self.wrong == 0 and len(draft) > 1:
                    draft[len(draft) // 2] = (draft[len(draft) // 2] + 1) % 1000
                return draft
        return []


class RandomProposer:
    """Drafts random tokens: (almost) nothing is accepted."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)

    def propose(self, text, hints, k):
        return self.rng.integers(5, 1000, size=k).tolist()


def drafter(proposer=None, **settings) -> Drafter:
    return Drafter(SpeculativeConfig(**{"cooldown_steps": 0, "prompt_lookup_min": 1, **settings}), proposer)


async def generate(engine: DecodeEngine, rid: str, prompt: list[int], sampling: SamplingParams, lora=None) -> list:
    handle = engine.register(rid, len(prompt), sampling, 1024, prompt, lora=lora)
    await engine.admit(handle)
    engine.prefill_locally(handle)
    outputs = []
    while True:
        out = await asyncio.wait_for(handle.events.get(), 60)
        assert not isinstance(out, Exception), out
        outputs.append(out)
        if out.finish_reason is not None:
            engine.release(rid)
            return outputs


async def run_all(runner, drafter_or_none, prompts, sampling: SamplingParams | list[SamplingParams], loras=None):
    """Every prompt's outputs, all in one batch; and whether the pool ended as it started."""
    engine = DecodeEngine(runner, paged_pool(runner, 8000), drafter=drafter_or_none)
    free = engine.pool.num_free
    engine.start()
    try:
        samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        loras = loras or [None] * len(prompts)
        got = await asyncio.gather(*(generate(engine, f"r{i}", p, s, lora) for i, (p, s, lora) in
                                     enumerate(zip(prompts, samplings, loras))))
    finally:
        engine.shutdown()
    assert engine.pool.num_free == free and engine.admission.budget.used == 0
    return got


def ids(outputs) -> list[int]:
    return [o.token_id for o in outputs]


GREEDY = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
async def test_greedy_tokens_with_drafts_are_the_tokens_without(runner, method):
    without = await run_all(runner, None, PROMPTS, GREEDY)
    for rows in (PROMPTS[:1], PROMPTS):
        planner = drafter(method=method)
        with_drafts = await run_all(runner, planner, rows, GREEDY)
        assert [ids(o) for o in with_drafts] == [ids(o) for o in without[: len(rows)]]
        assert planner.counts.drafts > 0


async def test_accepted_runs_emit_several_tokens_per_step_with_indexes_in_order(runner):
    without = await run_all(runner, None, PROMPTS, GREEDY)
    oracle = drafter(OracleProposer([p + ids(o) for p, o in zip(PROMPTS, without)], wrong=3))
    with_drafts = await run_all(runner, oracle, PROMPTS, GREEDY)
    assert [ids(o) for o in with_drafts] == [ids(o) for o in without]
    assert all([o.index for o in outs] == list(range(60)) for outs in with_drafts)
    counts = oracle.counts
    assert counts.accepted > counts.drafts  # more than one token per verified step on average
    assert counts.accepted < counts.draft_tokens  # and the wrong drafts were rejected
    assert counts.accepted_per_position[0] >= counts.accepted_per_position[-1] > 0


async def test_a_proposer_of_random_tokens_changes_nothing_and_gives_its_blocks_back(runner):
    without = await run_all(runner, None, PROMPTS, GREEDY)
    random_drafts = drafter(RandomProposer())
    with_drafts = await run_all(runner, random_drafts, PROMPTS, GREEDY)  # run_all checks the pool's blocks
    assert [ids(o) for o in with_drafts] == [ids(o) for o in without]
    assert random_drafts.counts.draft_tokens > 100


async def test_stop_strings_eos_and_max_tokens_inside_an_accepted_run_end_it_as_without_drafts(runner, hf_model):
    tokenizer = hf_model[1]
    without = await run_all(runner, None, PROMPTS, GREEDY)
    text = tokenizer.decode(ids(without[0]))
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    eos = ids(without[1])[17]  # a token the second prompt generates: as its stop token
    cases = [SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, stop=(stop,)),
             SamplingParams(max_tokens=60, temperature=0.0, stop_token_ids=(eos,)),
             SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, min_tokens=30, stop_token_ids=(eos,))]
    want = await run_all(runner, None, PROMPTS, cases)
    oracle = drafter(OracleProposer([p + ids(o) for p, o in zip(PROMPTS, without)]), num_speculative_tokens=8)
    got = await run_all(runner, oracle, PROMPTS, cases)
    assert [(ids(o), "".join(x.text for x in o), o[-1].finish_reason, o[-1].matched_stop) for o in got] == \
           [(ids(o), "".join(x.text for x in o), o[-1].finish_reason, o[-1].matched_stop) for o in want]
    assert len(got[0]) < 60 and len(got[2]) == 23
    assert oracle.counts.accepted > 0


async def test_seeded_sampling_and_penalties_give_the_same_tokens_with_drafts(runner):
    cases = [SamplingParams(max_tokens=40, temperature=1.0, seed=11 + i, ignore_eos=True, top_k=8,
                            repetition_penalty=1.0 if i % 2 else 1.3, frequency_penalty=0.5 if i == 3 else 0.0)
             for i in range(4)]
    without = await run_all(runner, None, PROMPTS, cases)
    oracle = drafter(OracleProposer([p + ids(o) for p, o in zip(PROMPTS, without)], wrong=2))
    got = await run_all(runner, oracle, PROMPTS, cases)
    assert [ids(o) for o in got] == [ids(o) for o in without]
    assert oracle.counts.accepted > 0


async def test_logprobs_are_reported_for_every_token_of_an_accepted_run(runner):
    sampling = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, return_logprobs=True, top_logprobs=2)
    without = await run_all(runner, None, PROMPTS[:2], sampling)
    oracle = drafter(OracleProposer([p + ids(o) for p, o in zip(PROMPTS, without)]))
    got = await run_all(runner, oracle, PROMPTS[:2], sampling)
    for outs, refs in zip(got, without):
        for out, ref in zip(outs, refs):
            assert out.logprobs.logprob == pytest.approx(ref.logprobs.logprob, abs=1e-4)
            assert [t for t, _ in out.logprobs.top] == [t for t, _ in ref.logprobs.top]
    assert oracle.counts.accepted > 0


async def test_rows_under_lora_adapters_verify_their_drafts_under_their_own_adapter(model_dir, lora_adapters):
    runner = ModelRunner(model_dir, max_loras=4)
    loras = [None] + [LoadedLora(ref := AdapterRef(name, str(path), read_adapter(
        path, runner.lora_shapes, runner.num_layers, 16).digest), runner.load_lora(ref, slot), pins=1, slot=slot)
        for slot, (name, path) in enumerate(list(lora_adapters.items())[:3])]
    without = await run_all(runner, None, PROMPTS, GREEDY, loras)
    assert len({tuple(ids(o)) for o in without}) == 4
    oracle = drafter(OracleProposer([p + ids(o) for p, o in zip(PROMPTS, without)], wrong=3))
    got = await run_all(runner, oracle, PROMPTS, GREEDY, loras)
    assert [ids(o) for o in got] == [ids(o) for o in without]
    assert oracle.counts.accepted > oracle.counts.drafts


@pytest.mark.system  # 20,000 sampled requests: several seconds
async def test_sampled_tokens_with_drafts_follow_the_models_distribution(runner, hf_model):
    """The first drafted position's token over 20,000 seeded requests at temperature 1 (top-k 4): within total
    variation 0.02 of the model's own distribution, though the draft is accepted only with its probability."""
    prompt = PROMPTS[0][:20]
    kv = hf_prefill(hf_model, "x", prompt)
    with torch.inference_mode():
        logits = hf_model[0](torch.tensor([prompt + [kv.first_token_id]])).logits[0, -1].float()
    top = torch.topk(logits, 4)
    exact = torch.softmax(top.values, dim=-1)
    draft_token = int(top.indices[1])  # the second likeliest: accepted now and then, rejected often

    class Fixed:
        def propose(self, text, hints, k):
            return [draft_token]

    fixed = drafter(Fixed(), disable_batch_size=256)
    engine = DecodeEngine(runner, paged_pool(runner, 200_000), max_running=256, drafter=fixed)
    engine.start()
    counts = dict.fromkeys(top.indices.tolist(), 0)
    try:
        async def one(i: int) -> int:
            rid = f"s{i}"
            handle = engine.register(rid, len(prompt), SamplingParams(max_tokens=3, temperature=1.0, top_k=4,
                                                                      seed=i, ignore_eos=True), 64, prompt)
            await engine.admit(handle)
            engine.on_kv(dataclasses.replace(kv, request_id=rid))  # the same tensors: joining copies them
            outs = [await asyncio.wait_for(handle.events.get(), 120) for _ in range(2)]
            while outs[-1].finish_reason is None:
                outs.append(await asyncio.wait_for(handle.events.get(), 120))
            engine.release(rid)
            return outs[1].token_id

        n = 20_000
        for start in range(0, n, 1000):
            for token in await asyncio.gather(*(one(i) for i in range(start, start + 1000))):
                counts[token] += 1
    finally:
        engine.shutdown()
    observed = torch.tensor([counts[t] for t in top.indices.tolist()], dtype=torch.float32) / n
    assert 0.5 * float((observed - exact).abs().sum()) < 0.02
    accepted = fixed.counts.accepted / fixed.counts.drafts
    assert accepted == pytest.approx(float(exact[1]), abs=0.02)
