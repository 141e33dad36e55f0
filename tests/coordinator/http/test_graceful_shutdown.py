"""SIGTERM to the coordinator: it stops accepting, lets a running stream finish, then exits 0."""

from __future__ import annotations

import pytest

import json
import signal

import httpx

from tests.helpers import BackgroundStream, sse_events, start_coordinator, write_config

pytestmark = pytest.mark.system


def test_sigterm_drains_running_streams_then_exits_zero(cluster, tmp_path):
    coordinator = start_coordinator(write_config(tmp_path / "ms_coordinator.json", [cluster.prefill.address],
                                                 [cluster.decode.address], cluster.model_dir, maxIterTimes=300))
    body = {"model": "pdserve-tiny", "prompt": "Hello", "max_tokens": 300, "stream": True, "temperature": 0}
    reader = BackgroundStream(f"{coordinator.address}/v1/completions", body)
    assert reader.first_chunk.wait(30)
    coordinator.proc.send_signal(signal.SIGTERM)
    reader.join(60)
    payloads = sse_events(reader.raw)
    assert payloads[-1] == "[DONE]"
    final = json.loads(payloads[-2])
    assert final["choices"][0]["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 300
    assert coordinator.proc.wait(timeout=30) == 0
    try:
        httpx.get(f"{coordinator.address}/health", timeout=2)
        raise AssertionError("the coordinator still accepts connections after draining")
    except httpx.TransportError:
        pass
