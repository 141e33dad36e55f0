"""A coordinator and its prefill and decode workers exporting one request's trace over OTLP http/protobuf, chosen by
the standard OTEL_EXPORTER_OTLP_PROTOCOL, to a collector that speaks only HTTP (as a 4318 port does)."""

from __future__ import annotations

import secrets

import httpx
import pytest

from tests.helpers import ServerProcess, pdserve_argv, write_config
from tests.otlp_http_collector import TRACES_PATH, OtlpHttpCollector

pytestmark = pytest.mark.system


def test_every_process_exports_its_spans_of_a_request_over_http_protobuf(model_dir, tmp_path):
    collector = OtlpHttpCollector()
    env = collector.env()
    processes = []
    try:
        for role in ("prefill", "decode"):
            processes.append(ServerProcess(pdserve_argv("worker", "--role", role, "--port", "0", "--simulate"),
                                           "pdserve worker ready:", timeout_s=30, env=env))
        prefill, decode = processes
        config = write_config(tmp_path / "ms_coordinator.json", [prefill.address], [decode.address], model_dir)
        coordinator = ServerProcess(pdserve_argv("coordinator", "--config", str(config)), "pdserve coordinator ready:",
                                    env=env)
        processes.append(coordinator)
        trace_id = secrets.token_hex(16)
        resp = httpx.post(f"{coordinator.address}/v1/chat/completions", timeout=60,
                          headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"},
                          json={"model": "pdserve-tiny", "max_tokens": 8,
                                "messages": [{"role": "user", "content": "A prompt long enough for a prefill worker"}]})
        assert resp.status_code == 200, resp.text

        wanted = {("pdserve-coordinator", "POST /v1/chat/completions"), ("pdserve-prefill", "prefill"),
                  ("pdserve-decode", "decode")}
        collector.wait_for(lambda spans: wanted <= {(s.service, s.name) for s in spans if s.trace_id == trace_id})
        assert set(collector.paths) == {TRACES_PATH}  # /v1/traces appended to OTEL_EXPORTER_OTLP_ENDPOINT
    finally:
        for proc in processes:
            proc.stop()
        collector.stop()
