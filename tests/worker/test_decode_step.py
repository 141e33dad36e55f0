"""The bucketed decode step (decode_step.py): padded to its batch bucket, its buffers reused, it gives the packed
step's tokens at every batch size from 1 to 70 (above the largest bucket, 64, the packed step runs), on the
embedded and the real checkpoint; its padding rows write only the dummy slot."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from worker.engine.block_pool import BlockTable
from worker.torch_engine.build import paged_pool
from worker.torch_engine.decode_graphs import GRAPH_MAX_CONTEXT, graphs_refusal
from worker.torch_engine.decode_step import DUMMY_SLOT, batch_buckets, context_buckets
from worker.torch_engine.model_runner import DecodeRow, ModelRunner, PromptChunk

MAX_ROWS = 70
BLOCK = 16


def prefilled(runner: ModelRunner, n: int, lengths: tuple[int, int], seed: int = 7):
    """A pool with `n` sequences prefilled (prompts of random lengths in `lengths`), each with room for its next
    token; their DecodeRows."""
    pool = paged_pool(runner, n * (lengths[1] + BLOCK), BLOCK, max_decode_rows=64)
    rng = random.Random(seed)
    chunks = []
    for _ in range(n):
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randrange(*lengths))]
        table = BlockTable()
        assert pool.grow(table, len(prompt) + 1)
        chunks.append(PromptChunk(prompt, 0, table, True))
    firsts = runner.forward([], chunks).argmax(-1).tolist()  # one forward of every prompt
    return [DecodeRow(first, len(c.token_ids), c.table) for first, c in zip(firsts, chunks)]


def packed(runner: ModelRunner, rows) -> torch.Tensor:
    """Today's step: the packed forward, the decode step set aside."""
    step, runner.decode_step = runner.decode_step, None
    try:
        return runner.forward(rows, [])
    finally:
        runner.decode_step = step


def assert_bucketed_equals_packed(runner: ModelRunner, rows, reference: torch.Tensor | None = None) -> None:
    for n in range(1, len(rows) + 1):
        want = packed(runner, rows[:n]) if reference is None else reference[:n]
        got = runner.forward(rows[:n], [])
        assert got.shape == want.shape
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist(), n
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4, msg=f"{n} rows")


@pytest.mark.parametrize("attention", ["kernel", "torch"])
def test_the_padded_step_gives_the_packed_steps_tokens_at_every_batch_size_from_1_to_70(model_dir, attention):
    runner = ModelRunner(model_dir, device="cpu", attention=attention, pad_decode_steps=True)
    rows = prefilled(runner, MAX_ROWS, (2, 300))  # contexts across several context buckets (16 blocks and up)
    assert runner.decode_step.buckets == batch_buckets(64)
    assert not runner.decode_step.fits(rows[:65])  # 65 to 70: the packed step
    assert_bucketed_equals_packed(runner, rows)


@pytest.mark.system  # 70 forwards of the real checkpoint: about 18 s of one core
def test_the_real_checkpoint_padded_step_gives_the_packed_steps_tokens_at_every_batch_size(real_model_dir):
    runner = ModelRunner(real_model_dir, device="cpu", pad_decode_steps=True)
    rows = prefilled(runner, MAX_ROWS, (4, 24))
    # Rows are independent in a packed forward: one of all 70 is every smaller step's reference.
    assert_bucketed_equals_packed(runner, rows, reference=packed(runner, rows))


def test_padding_rows_write_only_the_dummy_slot(model_dir):
    runner = ModelRunner(model_dir, device="cpu", attention="torch", pad_decode_steps=True)
    rows = prefilled(runner, 13, (2, 60))
    keys = runner.cache.keys[0]
    before = keys.clone()
    runner.forward(rows, [])  # 13 rows, padded to 16
    bs = runner.block_size
    own = {row.table.block_ids[row.position // bs] * bs + row.position % bs for row in rows}
    same = (keys == before) | (keys.isnan() & before.isnan())  # blocks never handed out hold whatever was there
    changed = set((~same).any(-1).any(-1).nonzero().flatten().tolist())
    assert own <= changed <= own | {DUMMY_SLOT}  # padding wrote nowhere else (token 0 may write zeros)


def test_adapters_in_a_padded_step_give_the_packed_steps_tokens(model_dir, lora_adapters):
    from tests.worker.test_lora_runner import loaded

    runner = ModelRunner(model_dir, device="cpu", max_loras=4, pad_decode_steps=True)
    plain = prefilled(runner, 13, (2, 60), seed=11)
    loras = [loaded(runner, name, path, slot) for slot, (name, path) in enumerate(lora_adapters.items())]
    rows = [DecodeRow(r.token_id, r.position, r.table, ([None] + loras)[i % 4]) for i, r in enumerate(plain)]
    for n in (3, 13):
        assert runner.forward(rows[:n], []).argmax(-1).tolist() == packed(runner, rows[:n]).argmax(-1).tolist()
        torch.testing.assert_close(runner.forward(rows[:n], []), packed(runner, rows[:n]), atol=2e-4, rtol=1e-4)


def test_eager_steps_on_the_cpu_are_unpadded_and_never_captured(model_dir):
    runner = ModelRunner(model_dir, device="cpu")
    paged_pool(runner, 2048, BLOCK, max_decode_rows=48)
    assert runner.decode_step.buckets == tuple(range(1, 49))
    assert runner.capture_graphs() is None and runner.decode_step.graphs is None
    assert runner.graph_reserve_bytes(48, BLOCK) == 0
    assert graphs_refusal(torch.device("cpu"), False) == "the device is cpu, not CUDA"
    assert graphs_refusal(torch.device("cuda"), True) == "--enforce-eager"
    dynamic = SimpleNamespace(rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    assert "dynamic RoPE" in graphs_refusal(torch.device("cuda"), False, dynamic)
    assert graphs_refusal(torch.device("cuda"), False, SimpleNamespace(rope_parameters={"rope_type": "llama3"})) is None


def test_rows_past_the_steps_context_run_packed_and_the_tables_never_outgrow_the_pool(model_dir):
    runner = ModelRunner(model_dir, device="cpu", pad_decode_steps=True)
    paged_pool(runner, 4096, BLOCK)
    step = runner.decode_step
    assert step.columns == min(runner.max_context, GRAPH_MAX_CONTEXT) // BLOCK + 1
    paged_pool(runner, 64, BLOCK)  # 4 blocks and block 0: no row can hold more
    assert runner.decode_step is not step and step.graphs is None
    assert runner.decode_step.columns == 5 * BLOCK // BLOCK + 1
    table = BlockTable(list(range(1, 5)))
    assert runner.decode_step.fits([DecodeRow(3, 4 * BLOCK - 1, table)])
    assert not runner.decode_step.fits([DecodeRow(3, 6 * BLOCK, BlockTable(list(range(1, 5)) * 2))])


def test_batch_buckets_pad_at_most_seven_rows_and_end_at_the_largest():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert batch_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert batch_buckets(3) == (1, 2, 3)
    for n in range(1, 65):
        bucket = min(b for b in batch_buckets(64) if b >= n)
        assert bucket - n <= 7


def test_context_buckets_double_from_sixteen_blocks_to_the_tables_width():
    assert context_buckets(513) == (16, 32, 64, 128, 256, 512, 513)
    assert context_buckets(9) == (9,)
