"""LoRA adapters in the packed forward: a sequence's greedy tokens equal PEFT's own model under its adapter, with
the base and other adapters in the same forwards (prompt chunks and decode rows alike)."""

from __future__ import annotations

import random

import pytest

from adapters.peft_folder import read_adapter
from tests.helpers import peft_greedy
from worker.engine.block_pool import BlockTable
from worker.engine.lora import LoadedLora, AdapterRef, LoraUnavailable
from worker.torch_engine.build import paged_pool
from worker.torch_engine.model_runner import DecodeRow, ModelRunner, PromptChunk

NUM_NEW = 10
BLOCK = 16


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    return ModelRunner(model_dir, device="cpu", max_loras=4)


def loaded(runner: ModelRunner, name: str, path, slot: int) -> LoadedLora:
    ref = AdapterRef(name, str(path), read_adapter(path, runner.lora_shapes, runner.num_layers, 16).digest)
    return LoadedLora(ref, runner.load_lora(ref, slot), pins=1, slot=slot)


def test_mixed_adapters_in_one_forward_match_peft_greedy_tokens(runner, model_dir, lora_adapters):
    rng = random.Random(5)
    names = [None, "a1", "a2", "a3", None, "a1"]
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(5, 60))] for _ in names]
    loras = {name: loaded(runner, name, path, slot) for slot, (name, path) in enumerate(lora_adapters.items())}
    pool = paged_pool(runner, 8192, BLOCK)
    tables = [BlockTable() for _ in names]
    for table, prompt in zip(tables, prompts):
        assert pool.grow(table, len(prompt) + NUM_NEW)
    chunks = [PromptChunk(p, 0, t, True, lora=loras.get(n)) for n, p, t in zip(names, prompts, tables)]
    outputs = [[int(i)] for i in runner.forward([], chunks).argmax(-1)]
    for _ in range(NUM_NEW - 1):
        rows = [DecodeRow(out[-1], len(p) + len(out) - 1, t, loras.get(n))
                for n, p, t, out in zip(names, prompts, tables, outputs)]
        for out, token in zip(outputs, runner.forward(rows, []).argmax(-1)):
            out.append(int(token))
    for name, prompt, out in zip(names, prompts, outputs):
        assert out == peft_greedy(model_dir, lora_adapters.get(name), prompt, NUM_NEW), name
    assert outputs[1] != outputs[2] and outputs[0] != outputs[1]  # each adapter changes the output


def test_adapter_changed_since_the_coordinator_read_it_is_unavailable_here(runner, lora_adapters):
    ref = AdapterRef("a1", str(lora_adapters["a1"]), digest=12345)
    with pytest.raises(LoraUnavailable, match="differs"):
        runner.load_lora(ref, 3)
    with pytest.raises(LoraUnavailable, match="no such adapter folder"):
        runner.load_lora(AdapterRef("gone", "/nonexistent/adapter", digest=1), 3)
