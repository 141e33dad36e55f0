"""`pdserve up --encoders N`: encode workers started beside the cluster, registered and serving its images; the
combinations it cannot run are refused by name."""

from __future__ import annotations

import base64
import signal
import subprocess

import httpx
import pytest

from tests.helpers import (REPO, ServerProcess, cmdline, descendants, free_port, image_bytes, management_url,
                           pdserve_argv, registration_headers, scrape)

pytestmark = pytest.mark.system


def test_up_with_encoders_starts_encode_workers_that_encode_the_cluster_s_images(vlm_dir):
    up = ServerProcess(pdserve_argv("up", "--predict-port", str(free_port()), "--model", str(vlm_dir),
                                    "--encoders", "1"), "pdserve ready:", timeout_s=180)
    try:
        lines = [cmdline(p) for p in descendants(up.proc.pid)]
        assert sum("worker --role encode" in c for c in lines) == 1
        listed = httpx.get(f"{management_url(up)}/v1/instances", headers=registration_headers(up), timeout=10).json()
        assert [i["state"] for i in listed["encode"]] == ["healthy"]  # routable once `pdserve ready` is printed
        url = "data:image/png;base64," + base64.b64encode(image_bytes((90, 160, 40))).decode()
        reply = httpx.post(f"{up.address}/v1/chat/completions", timeout=120, json={
            "model": "pdserve-tiny-vlm", "max_tokens": 3, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]}]})
        assert reply.status_code == 200, reply.text
        figures = scrape(up.address)
        assert figures[("pdserve_encoder_images_total", (("outcome", "encoded"),))] == 1
        assert figures[("pdserve_encoder_images_total", (("outcome", "fallback"),))] == 0
    finally:
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=60) == 0


@pytest.mark.parametrize("flags,message", [
    (["--encoders", "-1"], "--encoders must be >= 0"),
    (["--encoders", "1", "--engine", "vllm"], "serves vLLM instances text prompts only"),
    (["--encoders", "1", "--gateway", "envoy"], "--encoders with --gateway envoy: not supported yet"),
])
def test_up_refuses_encoders_it_cannot_run_naming_why(flags, message):
    done = subprocess.run(pdserve_argv("up", *flags), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
