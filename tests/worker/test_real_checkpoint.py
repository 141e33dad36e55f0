"""The real checkpoint (SmolLM2-135M-Instruct, built offline by embedded_model/real_checkpoint.py) through PD:
greedy tokens equal transformers' `generate`, with the prompt chunked across block boundaries, and again from warm
prefix caches on both workers."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import health, start_coordinator, start_worker, transformers_greedy, wait_for_idle, write_config

pytestmark = pytest.mark.system

NEW_TOKENS = 24
PROMPT = ("The lighthouse keeper wrote in his log every night. " * 12
          + "On the last night of the season he wrote one more line:")


@pytest.fixture(scope="module")
def real_cluster(real_model_dir, tmp_path_factory):
    # Chunks of 64 tokens: the ~130-token prompt crosses chunk and block boundaries in the middle of blocks.
    prefill = start_worker("prefill", real_model_dir, "--max-prefill-tokens", "64", "--kv-budget-tokens", "8192")
    decode = start_worker("decode", real_model_dir, "--kv-budget-tokens", "8192")
    coordinator = start_coordinator(write_config(tmp_path_factory.mktemp("real") / "ms_coordinator.json",
                                                 [prefill.address], [decode.address], real_model_dir,
                                                 modelName="smollm2", maxIterTimes=64))
    yield prefill, decode, coordinator.address
    for proc in (coordinator, prefill, decode):
        proc.stop()


@pytest.fixture(scope="module")
def reference(real_model_dir):
    tokenizer, ids, tokens = transformers_greedy(real_model_dir, PROMPT, NEW_TOKENS)
    return ids, tokens


def complete(url: str) -> dict:
    resp = httpx.post(f"{url}/v1/completions", json={
        "model": "smollm2", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "return_token_ids": True,
        "ignore_eos": True}, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def test_real_checkpoint_greedy_tokens_equal_generate_cold_and_from_warm_prefix_caches(real_cluster, reference):
    prefill, decode, url = real_cluster
    ids, want = reference
    assert len(ids) > 2 * 64  # three chunks
    cold = complete(url)
    assert cold["prompt_token_ids"] == ids and cold["token_ids"] == want
    wait_for_idle(decode.address, "decode")
    hits = health(prefill.address, "prefill").prefix_hit_tokens, health(decode.address, "decode").prefix_hit_tokens
    warm = complete(url)
    assert warm["token_ids"] == want
    cached = (len(ids) - 1) // 16 * 16
    assert health(prefill.address, "prefill").prefix_hit_tokens - hits[0] == cached
    assert health(decode.address, "decode").prefix_hit_tokens - hits[1] == cached  # only the tail was sent
    wait_for_idle(prefill.address, "prefill")
    wait_for_idle(decode.address, "decode")
