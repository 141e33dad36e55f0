"""LoRA adapters through faults, each test on workers of its own: a request keeps its adapter when its decode worker
dies mid-stream (migration), when its sequence is preempted and recomputed, and when a worker cannot load the
adapter (another serves it)."""

from __future__ import annotations

import concurrent.futures
import json
import signal

import httpx
import pytest

from tests.helpers import (BackgroundStream, health, management_url, peft_greedy, scrape, serving_decode, sse_events,
                           start_coordinator, start_worker, write_config)

pytestmark = pytest.mark.system

LONG = {"maxIterTimes": 800, "maxSeqLen": 2048, "maxInputTokenLen": 2048}


def lora_config(tmp_path, prefill: list[str], decode: list[str], model_dir, adapters, **extra):
    return write_config(tmp_path / "ms_coordinator.json", prefill, decode, model_dir,
                        loraModules={name: str(path) for name, path in adapters.items()}, **extra)


def stop_all(*processes) -> None:
    for process in processes:
        process.proc.kill()
        process.proc.wait()


def test_a_stream_under_an_adapter_moves_to_another_decode_worker_with_peft_tokens(cluster, tmp_path, lora_adapters,
                                                                                  tokenizer):
    decodes = {w.address: w for w in (start_worker("decode", cluster.model_dir),
                                      start_worker("decode", cluster.model_dir))}
    coordinator = start_coordinator(lora_config(tmp_path, [cluster.prefill.address], list(decodes),
                                                cluster.model_dir, lora_adapters, **LONG))
    body = {"model": "a2", "prompt": "Hello", "max_tokens": 800, "stream": True, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    try:
        reader = BackgroundStream(f"{coordinator.address}/v1/completions", body)
        assert reader.first_chunk.wait(30)
        decodes[serving_decode(coordinator)].proc.send_signal(signal.SIGKILL)
        reader.join(120)
        chunks = [json.loads(p) for p in sse_events(reader.raw)[:-1]]
        assert not any("error" in c for c in chunks), chunks[-3:]
        streamed = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids", [])]
        assert len(streamed) == 800
        expected = peft_greedy(cluster.model_dir, lora_adapters["a2"], tokenizer("Hello")["input_ids"], 800)
        assert streamed[: len(expected)] == expected  # PEFT's generate stops at EOS; the stream ignores it
        assert scrape(coordinator.address)[("pdserve_request_migrations_total", ())] == 1
    finally:
        coordinator.stop()
        stop_all(*decodes.values())


def test_preempted_sequences_under_adapters_are_recomputed_under_them(cluster, tmp_path, lora_adapters, tokenizer):
    # 384 positions for four sequences growing to about 200 each: they preempt one another and are recomputed.
    small = start_worker("decode", cluster.model_dir, "--kv-budget-tokens", "384")
    coordinator = start_coordinator(lora_config(tmp_path, [cluster.prefill.address], [small.address],
                                                cluster.model_dir, lora_adapters, **LONG))
    # Prompts whose greedy paths have no near-tie over 180 tokens: recomputed after preemption (one prefill over
    # the prompt and its tokens, not step by step), logits differ in the last float bits, so a top-2 margin of 1e-5
    # (a3 under "1 2 3 4" at its fifth token) could flip; the smallest margin here is 1.8e-4.
    jobs = [("a1", "Once upon a time"), ("a2", "The coordinator sends"), ("a3", "A B C D"),
            ("pdserve-tiny", "Hello there")]

    def run(job):
        model, prompt = job
        resp = httpx.post(f"{coordinator.address}/v1/completions", timeout=300, json={
            "model": model, "prompt": prompt, "max_tokens": 180, "temperature": 0, "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["token_ids"]

    try:
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            outputs = list(pool.map(run, jobs))
        assert health(small.address, "decode").num_preemptions > 0
        for (model, prompt), out in zip(jobs, outputs):
            adapter = lora_adapters.get(model)
            assert out == peft_greedy(cluster.model_dir, adapter, tokenizer(prompt)["input_ids"], 180), model
    finally:
        coordinator.stop()
        stop_all(small)


def test_a_worker_that_cannot_load_the_adapter_fails_the_attempt_and_another_serves_it(cluster, tmp_path,
                                                                                      lora_adapters, tokenizer):
    # Rank 8 adapters: the first decode worker takes rank 4 at most, so it cannot load them.
    limited = start_worker("decode", cluster.model_dir, "--max-lora-rank", "4")
    able = start_worker("decode", cluster.model_dir)
    coordinator = start_coordinator(lora_config(tmp_path, [cluster.prefill.address], [limited.address, able.address],
                                                cluster.model_dir, lora_adapters))
    try:
        expected = peft_greedy(cluster.model_dir, lora_adapters["a1"], tokenizer("Hello")["input_ids"], 6)
        for _ in range(4):  # round robin: some of them are sent to the limited worker first
            resp = httpx.post(f"{coordinator.address}/v1/completions", timeout=60, json={
                "model": "a1", "prompt": "Hello", "max_tokens": 6, "temperature": 0, "return_token_ids": True})
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["token_ids"] == expected[:6]
        # Nothing is counted against the limited worker: it serves the base model as before.
        states = httpx.get(f"{management_url(coordinator)}/v1/instances", timeout=10).json()["decode"]
        limited_state = next(i for i in states if i["address"] == limited.address)
        assert limited_state["state"] == "healthy" and limited_state["consecutive_failures"] == 0
        assert scrape(coordinator.address)[("pdserve_prefill_retries_total", ())] >= 1  # restarted before a token
    finally:
        coordinator.stop()
        stop_all(limited, able)
