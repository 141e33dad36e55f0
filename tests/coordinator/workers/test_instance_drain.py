"""POST /v1/instances/drain and /resume: an instance out of routing, its streams moved once the budget ends with
their text unchanged, and back into routing on resume."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers import (BackgroundStream, instance_states, management_url, scrape, sse_events, start_coordinator,
                           start_worker, wait_for, write_config)

pytestmark = pytest.mark.system

LONG_TOKENS = 1500  # still streaming when the drain's short budget ends


def test_a_drained_decode_worker_takes_no_requests_its_streams_move_unchanged_and_it_comes_back_on_resume(
        cluster, tmp_path):
    drained, other = start_worker("decode", cluster.model_dir), start_worker("decode", cluster.model_dir)
    config = write_config(tmp_path / "ms_coordinator.json", [cluster.prefill.address], [drained.address, other.address],
                          cluster.model_dir, {"rebalance_config": {"enabled": True, "min_imbalance": 100}},
                          maxIterTimes=2000, maxSeqLen=2048, maxInputTokenLen=2048)
    coordinator = start_coordinator(config)
    manage = management_url(coordinator)
    body = {"model": "pdserve-tiny", "prompt": "Hello", "max_tokens": LONG_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    try:
        # Streams on both decode workers; those on the other one run undisturbed.
        readers = [BackgroundStream(f"{coordinator.address}/v1/completions", body) for _ in range(4)]
        for reader in readers:
            assert reader.first_chunk.wait(30)
        on_it = {i["address"]: i["outstanding_requests"]
                 for i in httpx.get(f"{manage}/v1/instances", timeout=10).json()["decode"]}[drained.address]
        assert on_it >= 1
        answer = httpx.post(f"{manage}/v1/instances/drain", json={"address": drained.address, "drain_timeout_s": 0},
                            timeout=60)
        assert answer.status_code == 200, answer.text
        drained_answer = answer.json()
        # Each stream on it moves, but for one whose last token's text is not out whole at that moment: it stays
        # (and ends there). The policy balances load, so which streams went where depends on their timing.
        assert drained_answer["moved"] >= 1 and drained_answer["moved"] + drained_answer["left"] == on_it
        assert drained_answer["state"] == "draining"
        assert instance_states(coordinator)["decode"][drained.address] == "draining"
        texts = []
        for reader in readers:
            reader.join(120)
            payloads = sse_events(reader.raw)
            assert payloads[-1] == "[DONE]", payloads[-3:]
            texts.append("".join(c["choices"][0]["text"] for c in map(json.loads, payloads[:-1]) if c.get("choices")))
        assert len(set(texts)) == 1
        assert scrape(manage)[("pdserve_request_rebalances_total", ())] == drained_answer["moved"]
        # Held out whatever its health checks say: a new request goes to the other one.
        httpx.post(f"{coordinator.address}/v1/completions", json={**body, "stream": False, "max_tokens": 4},
                   timeout=60).raise_for_status()
        served = {i["address"]: i["served"] for i in httpx.get(f"{manage}/v1/instances", timeout=10).json()["decode"]}
        assert served[drained.address] == on_it
        resumed = httpx.post(f"{manage}/v1/instances/resume", json={"address": drained.address}, timeout=30)
        assert resumed.status_code == 200 and resumed.json()["state"] == "healthy"
        refused = httpx.post(f"{manage}/v1/instances/drain", json={"address": "127.0.0.1:1"}, timeout=10)
        assert refused.status_code == 404 and "127.0.0.1:1" in refused.json()["error"]["message"]
        bad = httpx.post(f"{manage}/v1/instances/drain", json={"address": drained.address, "drain_timeout_s": -1},
                         timeout=10)
        assert bad.status_code == 400 and "drain_timeout_s" in bad.json()["error"]["message"]
    finally:
        coordinator.stop()
        drained.stop()
        other.stop()
