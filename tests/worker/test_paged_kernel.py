"""The engine's paged-attention kernel against the torch reference on random block tables, its work plan's
groups, and how a worker chooses it."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from worker.torch_engine import kernels
from worker.torch_engine.attention_plan import GROUP_ROWS, MIN_SHARED_BLOCKS, PROMPT_TILE, build_plan, decode_groups
from worker.torch_engine.model_support import resolve_attention

BS, HQ, HKV, D = 16, 6, 2, 32


@pytest.fixture(scope="module", autouse=True)
def kernel():
    kernels.load()


def reference(q, k_pool, v_pool, block_ids, last):
    """One query token [Hq, D] attending positions [0, last] of its blocks, gathered, by SDPA."""
    slots = (torch.tensor(block_ids).unsqueeze(1) * BS + torch.arange(BS)).reshape(-1)[: last + 1]
    k, v = k_pool[slots].float().transpose(0, 1), v_pool[slots].float().transpose(0, 1)
    return F.scaled_dot_product_attention(q.float().unsqueeze(1), k, v, enable_gqa=True).squeeze(1)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_the_kernel_matches_gathered_sdpa_on_random_tables_groups_and_prompt_tiles(dtype, tolerance):
    rng = random.Random(11)
    torch.manual_seed(11)
    num_blocks = 400
    k_pool = torch.randn(num_blocks * BS, HKV, D).to(dtype)
    v_pool = torch.randn(num_blocks * BS, HKV, D).to(dtype)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    system = [free.pop() for _ in range(5)]
    decode = []  # (block ids, position): a group sharing `system`, n=3 choices of one prompt, rows alone
    choices = system + [free.pop() for _ in range(3)]
    for i in range(14):
        base = system if i < 6 else choices if i < 9 else []
        ids = base + [free.pop() for _ in range(rng.randrange(1, 6))]
        decode.append((ids, rng.randrange((len(ids) - 1) * BS, len(ids) * BS)))
    chunk_ids = [free.pop() for _ in range(9)]
    chunks = [(chunk_ids, len(decode), 70, 60)]  # 60 prompt tokens at positions 70..129, after the decode rows
    plan = build_plan(decode, chunks, BS)
    tokens = len(decode) + 60
    q = torch.randn(tokens, HQ, D).to(dtype)
    out = torch.zeros_like(q)
    torch.ops.pdserve.paged_attention(out, q, k_pool, v_pool, plan.tables, plan.queries, plan.items, D ** -0.5, BS)
    expected = [reference(q[i], k_pool, v_pool, ids, pos) for i, (ids, pos) in enumerate(decode)]
    expected += [reference(q[len(decode) + i], k_pool, v_pool, chunk_ids, 70 + i) for i in range(60)]
    assert torch.allclose(out.float(), torch.stack(expected), atol=tolerance, rtol=tolerance)
    groups = {tuple(sorted(plan.queries[a:b, 0].tolist())): s for a, b, s in plan.items.tolist() if s and b <= 14}
    assert groups == {tuple(range(6)): 5, (6, 7, 8): 8}  # each group's blocks read once, the choices' deeper


def test_rows_are_grouped_by_the_leading_blocks_they_share_whatever_the_others_hold():
    system, other = [1, 2, 3, 4], [9, 8]
    tables = [system + [10], [20, 21, 22], system + [11, 12], other + [30], [40], other + [31], system + [13]]
    positions = [70, 40, 90, 40, 5, 45, 66]
    groups = sorted((sorted(rows), shared) for rows, shared in decode_groups(tables, positions, BS))
    assert groups == [([0, 2, 6], 4), ([1], 0), ([3, 5], 2), ([4], 0)]
    # A row's current block is never shared, however many rows hold its id.
    assert decode_groups([[5, 6], [5, 6]], [20, 20], BS) == [([0], 0), ([1], 0)]
    assert MIN_SHARED_BLOCKS == 2


def test_a_big_group_is_split_so_every_core_has_work_and_prompts_are_cut_into_tiles():
    rows = [([1, 2, 3, 100 + i], 60) for i in range(GROUP_ROWS + 3)]
    plan = build_plan(rows, [([7, 8, 9], len(rows), 16, 30)], BS)
    sizes = [(b - a, s) for a, b, s in plan.items.tolist()]
    assert sizes == [(GROUP_ROWS, 3), (3, 3), (PROMPT_TILE, 2), (30 - PROMPT_TILE, 3)]


@pytest.mark.system
def test_a_compiler_that_fails_is_reported_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(kernels.KernelUnavailable, match="compiling paged_attention.cpp failed"):
        kernels.build(tmp_path / "k.so")
    monkeypatch.setenv("CXX", "")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(kernels.KernelUnavailable, match="no C.. compiler found"):
        kernels.build(tmp_path / "k.so")


def test_an_unknown_backend_or_the_kernel_on_cuda_is_refused_by_name():
    with pytest.raises(ValueError, match="--attention fast: must be one of auto, kernel, torch"):
        resolve_attention("fast", torch.device("cpu"))
    with pytest.raises(ValueError, match="the paged kernel runs on the CPU only, not cuda"):
        resolve_attention("kernel", torch.device("cuda"))
    assert resolve_attention("auto", torch.device("cuda")) == "torch"


def test_a_block_size_the_kernel_cannot_read_falls_back_to_torch_or_is_refused_when_asked_for(model_dir):
    from worker.torch_engine.model_runner import ModelRunner

    runner = ModelRunner(model_dir, device="cpu")
    assert runner.attention == "kernel"
    runner.allocate_cache(8, 4)
    assert runner.attention == "torch"
    with pytest.raises(ValueError, match="--attention kernel: the paged kernel needs a block size .* multiples of 8"):
        ModelRunner(model_dir, device="cpu", attention="kernel").allocate_cache(8, 12)
