"""A decode worker killed mid-stream: the client gets a final error event in its API's format
within 2 s, the coordinator stays up."""

from __future__ import annotations

import pytest

import json
import signal
import time

import httpx

from tests.helpers import BackgroundStream, sse_events, start_coordinator, start_worker, write_config

pytestmark = pytest.mark.system


def test_decode_worker_death_ends_the_stream_with_an_error_event(cluster, tmp_path):
    victim = start_worker("decode", cluster.model_dir)
    coordinator = start_coordinator(write_config(tmp_path / "ms_coordinator.json", [cluster.prefill.address],
                                                 [victim.address], cluster.model_dir, maxIterTimes=450))
    body = {"model": "pdserve-tiny", "prompt": "Hello", "max_tokens": 450, "stream": True, "temperature": 0}
    try:
        reader = BackgroundStream(f"{coordinator.address}/v1/completions", body)
        assert reader.first_chunk.wait(30)
        killed = time.monotonic()
        victim.proc.send_signal(signal.SIGKILL)
        reader.join(30)
        assert reader.ended_at - killed < 2.0
        payloads = sse_events(reader.raw)
        assert payloads[-1] == "[DONE]"
        final = json.loads(payloads[-2])
        assert final["choices"][0]["finish_reason"] == "stop"
        assert f"decode worker {victim.address}" in final["error"]["message"]
        assert len(payloads) - 2 < 450  # it really was cut short
        assert httpx.get(f"{coordinator.address}/v1/models", timeout=10).status_code == 200
    finally:
        victim.proc.kill()
        coordinator.stop()
