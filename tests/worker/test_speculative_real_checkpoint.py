"""The real checkpoint (SmolLM2-135M-Instruct) through PD with a drafting decode worker: an answer that copies its
context is drafted from it, accepted in runs, and its greedy tokens are transformers' own, stop string included."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import (metrics_url, scrape, start_coordinator, start_worker, transformers_greedy,
                           wait_for_idle, write_config)

pytestmark = pytest.mark.system

NEW_TOKENS = 64
LINES = [f"def handler_{i}(request):\n    value = request.get('field_{i}', {3 * i})\n    return value * {i % 7 + 1}\n"
         for i in range(12)]
PROMPT = "Original file:\n" + "".join(LINES) + "\nThe same file with handler_3 returning value * 9:\n" + LINES[0]


@pytest.fixture(scope="module")
def drafting_cluster(real_model_dir, tmp_path_factory):
    prefill = start_worker("prefill", real_model_dir, "--kv-budget-tokens", "8192")
    decode = start_worker("decode", real_model_dir, "--kv-budget-tokens", "8192", "--speculative-method", "ngram")
    coordinator = start_coordinator(write_config(tmp_path_factory.mktemp("spec") / "ms_coordinator.json",
                                                 [prefill.address], [decode.address], real_model_dir,
                                                 modelName="smollm2", maxIterTimes=NEW_TOKENS))
    yield decode, coordinator.address
    for proc in (coordinator, prefill, decode):
        proc.stop()


@pytest.fixture(scope="module")
def reference(real_model_dir):
    tokenizer, ids, tokens = transformers_greedy(real_model_dir, PROMPT, NEW_TOKENS)
    return tokenizer, tokens


def complete(url: str, **fields) -> dict:
    resp = httpx.post(f"{url}/v1/completions", json={
        "model": "smollm2", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "return_token_ids": True,
        "ignore_eos": True, **fields}, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def test_a_copying_answer_is_drafted_from_its_context_and_equals_greedy_generate(drafting_cluster, reference):
    decode, url = drafting_cluster
    tokenizer, want = reference
    metrics = metrics_url(decode)
    choice = complete(url)
    assert choice["token_ids"] == want
    samples = scrape(metrics)
    drafts = samples[("pdserve_worker_spec_decode_num_drafts_total", ())]
    accepted = samples[("pdserve_worker_spec_decode_num_accepted_tokens_total", ())]
    assert drafts > 0 and 1 + accepted / drafts >= 2  # the copied lines come several tokens per step

    # A stop string in the middle of the copied lines ends the answer inside an accepted run, as it would without.
    text = tokenizer.decode(want)
    stop = LINES[2].split("\n")[1].strip()
    stopped = complete(url, stop=[stop])
    assert stopped["finish_reason"] == "stop" and stopped["text"] == text[: text.index(stop)]
    wait_for_idle(decode.address, "decode")
