"""Packed forwards over the block pool: a sequence's greedy tokens equal `model.generate`'s whatever else shares
the forward, however its prompt is chunked, and whether its prefix came from the cache."""

from __future__ import annotations

import random

import pytest
import torch

from worker.engine.block_pool import BlockTable
from worker.torch_engine.build import paged_pool
from worker.torch_engine.model_runner import DecodeRow, ModelRunner, PromptChunk

NUM_NEW = 12
BLOCK = 16


@pytest.fixture(scope="module", params=["kernel", "torch"])
def runner(model_dir, request) -> ModelRunner:
    """Both attention paths: the engine's paged kernel and the torch reference it is checked against."""
    return ModelRunner(model_dir, device="cpu", attention=request.param)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(2, 90))] for _ in range(16)]


def generate(hf_model, prompt: list[int], n: int = NUM_NEW) -> list[int]:
    """Greedy tokens of the checkpoint loaded as transformers loads it (its own attention and cache)."""
    with torch.inference_mode():
        out = hf_model[0].generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def reference(hf_model, prompts) -> list[list[int]]:
    return [generate(hf_model, p) for p in prompts]


class Harness:
    """Drives ModelRunner as the engines do: prompts in chunks, then one packed decode row per sequence."""

    def __init__(self, runner: ModelRunner, tokens: int = 8192, chunk: int = 10_000):
        self.runner = runner
        self.pool = paged_pool(runner, tokens, BLOCK)
        self.chunk = chunk
        self.seqs: dict[str, tuple[list[int], BlockTable, list[int]]] = {}

    def join(self, rid: str, prompt: list[int], cached: bool = False) -> int:
        """Prefill `prompt` (from its first uncached block when `cached`); return the positions found cached."""
        table = BlockTable()
        start = self.pool.cached_prefix(prompt, len(prompt) - 1, table) if cached else 0
        assert self.pool.grow(table, len(prompt))
        hit = start
        while start < len(prompt):
            end = min(len(prompt), start + self.chunk)
            logits = self.runner.forward([], [PromptChunk(prompt[start:end], start, table, end == len(prompt))])
            self.pool.register(table, prompt, end)
            start = end
        self.seqs[rid] = (prompt, table, [int(logits[-1].argmax())])
        return hit

    def leave(self, rid: str) -> list[int]:
        _, table, out = self.seqs.pop(rid)
        self.pool.release(table)
        return out

    def step(self) -> None:
        rows = []
        for prompt, table, out in self.seqs.values():
            assert self.pool.grow(table, len(prompt) + len(out))
            rows.append(DecodeRow(out[-1], len(prompt) + len(out) - 1, table))
        logits = self.runner.forward(rows, [])
        for (_, _, out), row in zip(self.seqs.values(), logits):
            out.append(int(row.argmax()))

    def run_until_done(self, n: int = NUM_NEW) -> dict[str, list[int]]:
        done = {}
        while self.seqs:
            self.step()
            for rid in [rid for rid, (_, _, out) in self.seqs.items() if len(out) >= n]:
                done[rid] = self.leave(rid)
        return done


def test_a_batch_of_16_mixed_lengths_matches_each_sequence_alone(runner, prompts, reference):
    harness = Harness(runner)
    free_at_start = harness.pool.num_free
    for i, p in enumerate(prompts):
        harness.join(str(i), p)
    done = harness.run_until_done()
    assert [done[str(i)] for i in range(len(prompts))] == reference
    assert harness.pool.num_free == free_at_start  # every block came back (full ones as cached)


def test_sequences_joining_and_leaving_mid_batch_do_not_change_the_others(runner, prompts, reference):
    harness = Harness(runner)
    done = {}
    for i, p in enumerate(prompts[:8]):
        harness.join(str(i), p)
    for step in range(NUM_NEW):
        if step == 3:
            for i in range(8, 16):  # newcomers join a batch already 4 tokens in
                harness.join(str(i), prompts[i])
        harness.step()
        for rid in [rid for rid, (_, _, out) in harness.seqs.items() if len(out) >= NUM_NEW]:
            done[rid] = harness.leave(rid)
    done.update(harness.run_until_done())
    assert [done[str(i)] for i in range(16)] == reference


@pytest.mark.parametrize("chunk", [1, 7, 16, 33])
def test_a_prompt_prefilled_in_chunks_across_block_boundaries_matches_one_forward(runner, prompts, reference, chunk):
    harness = Harness(runner, chunk=chunk)
    for i in (1, 5, 9):
        harness.join(str(i), prompts[i])
    done = harness.run_until_done()
    assert [done[str(i)] for i in (1, 5, 9)] == [reference[i] for i in (1, 5, 9)]


def test_a_warm_prefix_cache_computes_only_the_new_blocks_and_matches_a_cold_run(runner, hf_model):
    rng = random.Random(11)
    system = [rng.randrange(3, 1000) for _ in range(50)]
    first, second = system + [7, 8, 9], system + [rng.randrange(3, 1000) for _ in range(20)]
    harness = Harness(runner)
    assert harness.join("a", first, cached=True) == 0
    harness.run_until_done()
    assert harness.join("b", second, cached=True) == 48  # three full blocks of the shared 50 tokens
    assert harness.run_until_done()["b"] == generate(hf_model, second)
    assert harness.pool.hit_tokens == 48


def test_long_decodes_take_blocks_as_they_grow_and_give_them_all_back(runner, prompts, hf_model):
    harness = Harness(runner, tokens=2048)
    free_at_start = harness.pool.num_free
    for i in range(4):
        harness.join(str(i), prompts[i][:5])
    done = harness.run_until_done(n=70)  # crosses several block boundaries after the prompt
    assert done["0"] == generate(hf_model, prompts[0][:5], 70)
    assert harness.pool.num_free == free_at_start


def test_garbage_in_never_written_pool_memory_never_reaches_the_output(runner, prompts, reference):
    # Pool memory is left uninitialised until a block is first handed out; NaN there must not leak through the
    # masked positions of a block attention reads whole.
    harness = Harness(runner)
    for t in runner.cache.keys + runner.cache.values:
        t[runner.block_size:].fill_(float("nan"))
    for i in (0, 3):
        harness.join(str(i), prompts[i])
    done = harness.run_until_done()
    assert [done["0"], done["3"]] == [reference[0], reference[3]]


@pytest.mark.parametrize("config, refused", [
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding-window attention"),
    ({"model_type": "gemma2", "attn_logit_softcapping": 50.0}, "soft-capping"),
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}, None),
    ({"model_type": "llama"}, None),
])
def test_attention_the_paged_function_does_not_compute_is_refused_at_start_up_by_name(config, refused):
    from types import SimpleNamespace

    from worker.torch_engine.model_support import refuse_unsupported_attention

    if refused is None:
        refuse_unsupported_attention(SimpleNamespace(**config))
    else:
        with pytest.raises(ValueError, match=refused):
            refuse_unsupported_attention(SimpleNamespace(**config))


def test_rows_sharing_cached_leading_blocks_attend_them_once_with_the_same_tokens(runner, hf_model):
    from worker.torch_engine.model_runner import MIN_SHARED_BLOCKS, DecodeRow, shared_leading_blocks

    rng = random.Random(5)
    system = [rng.randrange(3, 1000) for _ in range(90)]  # 5 full blocks shared through the prefix cache
    prompts = [system + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    harness = Harness(runner)
    for i, p in enumerate(prompts):
        harness.join(str(i), p, cached=True)
    rows = [DecodeRow(out[-1], len(p) + len(out) - 1, table) for p, table, out in harness.seqs.values()]
    assert len(shared_leading_blocks(rows, BLOCK)) == 5 >= MIN_SHARED_BLOCKS  # the cascade path runs
    done = harness.run_until_done()
    assert [done[str(i)] for i in range(6)] == [generate(hf_model, p) for p in prompts]


def test_groups_sharing_different_prefixes_beside_unshared_rows_keep_every_sequences_tokens(runner, hf_model):
    from worker.torch_engine.attention_plan import decode_groups

    rng = random.Random(8)
    systems = [[rng.randrange(3, 1000) for _ in range(70)] for _ in range(2)]  # 4 shared blocks each
    prompts = [systems[i % 2] + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 40))] for i in range(6)]
    prompts += [[rng.randrange(3, 1000) for _ in range(rng.randrange(20, 80))] for _ in range(3)]  # alone
    harness = Harness(runner)
    for i, p in enumerate(prompts):
        harness.join(str(i), p, cached=True)
    tables = [table.block_ids for _, table, _ in harness.seqs.values()]
    positions = [len(p) for p, _, _ in harness.seqs.values()]
    groups = sorted((sorted(rows), shared) for rows, shared in decode_groups(tables, positions, BLOCK))
    assert groups == [([0, 2, 4], 4), ([1, 3, 5], 4), ([6], 0), ([7], 0), ([8], 0)]
    done = harness.run_until_done()
    assert [done[str(i)] for i in range(len(prompts))] == [generate(hf_model, p) for p in prompts]
