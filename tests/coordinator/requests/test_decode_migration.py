"""A decode worker lost mid-stream: the request moves to another decode worker (prompt + tokens
already sent are prefilled again) and the client's stream just continues."""

from __future__ import annotations

import pytest

import json
import signal
import time

import httpx

from tests.helpers import (BackgroundStream, instance_states, reference_tokens, scrape, serving_decode, sse_events,
                          start_coordinator, start_worker, write_config)

pytestmark = pytest.mark.system

MAX_TOKENS = 800  # long enough to still be streaming when the kill lands, even on an idle machine
LONG = {"maxIterTimes": MAX_TOKENS, "maxSeqLen": 2048, "maxInputTokenLen": 2048}


def test_a_stream_whose_decode_worker_dies_continues_on_another_with_the_same_tokens(cluster, tmp_path, hf_model):
    decodes = {w.address: w for w in (start_worker("decode", cluster.model_dir),
                                      start_worker("decode", cluster.model_dir))}
    coordinator = start_coordinator(write_config(tmp_path / "ms_coordinator.json", [cluster.prefill.address],
                                                 list(decodes), cluster.model_dir, **LONG))
    body = {"model": "pdserve-tiny", "prompt": "Hello", "max_tokens": MAX_TOKENS, "stream": True,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    try:
        reader = BackgroundStream(f"{coordinator.address}/v1/completions", body)
        assert reader.first_chunk.wait(30)
        victim = serving_decode(coordinator)
        decodes[victim].proc.send_signal(signal.SIGKILL)
        reader.join(60)
        payloads = sse_events(reader.raw)
        assert payloads[-1] == "[DONE]"
        chunks = [json.loads(p) for p in payloads[:-1]]
        assert not any("error" in c for c in chunks), chunks[-3:]
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS
        finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finals[-1] == "length"
        prompt_ids = hf_model[1]("Hello")["input_ids"]
        streamed = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids", [])]
        # Greedy decoding resumed from prompt + sent tokens gives exactly the uninterrupted sequence.
        assert streamed == reference_tokens(hf_model, prompt_ids, MAX_TOKENS)
        assert scrape(coordinator.address)[("pdserve_request_migrations_total", ())] == 1
        assert instance_states(coordinator)["decode"][victim] == "unhealthy"
        # Later requests avoid the dead worker and succeed.
        for _ in range(3):
            resp = httpx.post(f"{coordinator.address}/v1/completions", timeout=60, json={
                "model": "pdserve-tiny", "prompt": "Hi", "max_tokens": 3})
            assert resp.status_code == 200, resp.text
    finally:
        coordinator.stop()
        for worker in decodes.values():
            worker.proc.kill()
            worker.proc.wait()


def test_with_migration_off_a_lost_decode_worker_ends_the_stream_with_an_error(cluster, tmp_path):
    decodes = [start_worker("decode", cluster.model_dir), start_worker("decode", cluster.model_dir)]
    coordinator = start_coordinator(write_config(
        tmp_path / "ms_coordinator.json", [cluster.prefill.address], [w.address for w in decodes],
        cluster.model_dir, sections={"exception_config": {"max_migrations": 0}}, **LONG))
    body = {"model": "pdserve-tiny", "prompt": "Hello", "max_tokens": MAX_TOKENS, "stream": True,
            "temperature": 0, "ignore_eos": True}
    try:
        reader = BackgroundStream(f"{coordinator.address}/v1/completions", body)
        assert reader.first_chunk.wait(30)
        victim = serving_decode(coordinator)
        next(w for w in decodes if w.address == victim).proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        reader.join(30)
        assert reader.ended_at - killed < 2.0
        final = json.loads(sse_events(reader.raw)[-2])
        assert f"decode worker {victim}" in final["error"]["message"]
        assert final["choices"][0]["finish_reason"] == "stop"
    finally:
        coordinator.stop()
        for worker in decodes:
            worker.proc.kill()
            worker.proc.wait()
