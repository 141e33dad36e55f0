"""Conditional disaggregation: prompts shorter than `local_prefill_max_tokens` are prefilled on the
decode worker itself; longer ones still go through a prefill worker."""

from __future__ import annotations

import pytest

import httpx

from tests.helpers import management_url, reference_tokens, start_coordinator, write_config

pytestmark = pytest.mark.system


def served(coordinator, role: str) -> int:
    body = httpx.get(f"{management_url(coordinator)}/v1/instances", timeout=5).json()
    return sum(i["served"] for i in body[role])


def test_short_prompts_skip_the_prefill_worker_and_keep_greedy_parity(cluster, tmp_path, hf_model):
    coordinator = start_coordinator(write_config(
        tmp_path / "ms_coordinator.json", [cluster.prefill.address], [cluster.decode.address], cluster.model_dir,
        sections={"digs_scheduler_config": {"local_prefill_max_tokens": 8}}))
    tokenizer = hf_model[1]
    short, long = "Hello there", "Once upon a time there was a little server that served tokens."
    assert len(tokenizer(short)["input_ids"]) < 8 <= len(tokenizer(long)["input_ids"])
    try:
        for _ in range(2):
            resp = httpx.post(f"{coordinator.address}/v1/completions", timeout=60, json={
                "model": "pdserve-tiny", "prompt": short, "max_tokens": 10, "temperature": 0,
                "return_token_ids": True})
            assert resp.status_code == 200, resp.text
            choice = resp.json()["choices"][0]
            assert choice["token_ids"] == reference_tokens(hf_model, choice["prompt_token_ids"], 10)
        assert served(coordinator, "prefill") == 0
        assert served(coordinator, "decode") == 2
        resp = httpx.post(f"{coordinator.address}/v1/completions", timeout=60, json={
            "model": "pdserve-tiny", "prompt": long, "max_tokens": 10, "temperature": 0, "return_token_ids": True})
        choice = resp.json()["choices"][0]
        assert choice["token_ids"] == reference_tokens(hf_model, choice["prompt_token_ids"], 10)
        assert served(coordinator, "prefill") == 1
    finally:
        coordinator.stop()
