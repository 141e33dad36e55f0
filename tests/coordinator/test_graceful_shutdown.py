"""SIGTERM to the coordinator: it stops accepting, lets a running stream finish, then exits 0."""

from __future__ import annotations

import json
import signal
import threading

import httpx

from tests.conftest import sse_events, start_coordinator, write_config


def test_sigterm_drains_running_streams_then_exits_zero(cluster, tmp_path):
    coordinator = start_coordinator(write_config(tmp_path / "ms_coordinator.json", [cluster.prefill.address],
                                                 [cluster.decode.address], cluster.model_dir, maxIterTimes=300))
    body = {"model": "pdserve-tiny", "prompt": "Hello", "max_tokens": 300, "stream": True, "temperature": 0}
    result = {}
    first_chunk = threading.Event()

    def stream():
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{coordinator.address}/v1/completions", json=body) as r:
                raw = b""
                for part in r.iter_raw():
                    raw += part
                    first_chunk.set()
                result["raw"] = raw

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_chunk.wait(30)
    coordinator.proc.send_signal(signal.SIGTERM)
    reader.join(60)
    payloads = sse_events(result["raw"])
    assert payloads[-1] == "[DONE]"
    final = json.loads(payloads[-2])
    assert final["choices"][0]["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 300
    assert coordinator.proc.wait(timeout=30) == 0
    try:
        httpx.get(f"{coordinator.address}/health", timeout=2)
        raise AssertionError("the coordinator still accepts connections after draining")
    except httpx.TransportError:
        pass
