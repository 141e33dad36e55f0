"""A bf16 cluster: the KV cache crosses processes in bf16 and greedy output still matches generate."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.helpers import start_coordinator, start_worker, write_config

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def bf16_cluster(model_dir, tmp_path_factory):
    prefill = start_worker("prefill", model_dir, "--dtype", "bfloat16")
    decode = start_worker("decode", model_dir, "--dtype", "bfloat16")
    config = write_config(tmp_path_factory.mktemp("bf16") / "ms_coordinator.json", [prefill.address],
                          [decode.address], model_dir)
    coordinator = start_coordinator(config)
    yield coordinator.address
    for proc in (coordinator, prefill, decode):
        proc.stop()


@pytest.mark.parametrize("prompt", ["Hello there", "The coordinator sends the prompt"])
def test_bf16_kv_transfer_keeps_greedy_parity(bf16_cluster, model_dir, prompt):
    from transformers import AutoModelForCausalLM

    resp = httpx.post(f"{bf16_cluster}/v1/completions", timeout=60, json={
        "model": "pdserve-tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, "return_token_ids": True})
    choice = resp.json()["choices"][0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    ids = choice["prompt_token_ids"]
    with torch.inference_mode():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids):].tolist()
    assert choice["token_ids"] == expected
