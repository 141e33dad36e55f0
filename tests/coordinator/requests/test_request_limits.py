"""request_limit: past max_requests in flight a request gets 429 with Retry-After at once; past
body_limit MB, 413."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.helpers import start_coordinator, write_config

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def limited_url(cluster, tmp_path_factory):
    path = write_config(tmp_path_factory.mktemp("limits") / "ms_coordinator.json", [cluster.prefill.address],
                        [cluster.decode.address], cluster.model_dir, maxIterTimes=400)
    config = json.loads(path.read_text())
    config["request_limit"] = {"max_requests": 2, "body_limit": 1}
    path.write_text(json.dumps(config))
    coordinator = start_coordinator(path)
    yield coordinator.address
    coordinator.stop()


def test_request_past_max_requests_gets_429_with_retry_after_at_once(limited_url):
    body = {"model": "pdserve-tiny", "prompt": "Hello", "max_tokens": 400, "temperature": 0}
    results = []

    def send():
        resp = httpx.post(f"{limited_url}/v1/completions", json=body, timeout=60)
        results.append((resp, time.monotonic()))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    served = [ended for r, ended in results if r.status_code == 200]
    refused = [(r, ended) for r, ended in results if r.status_code == 429]
    assert 1 <= len(served) and len(refused) >= 4 and len(served) + len(refused) == 8
    for resp, ended in refused:
        # At once: answered while the requests holding the slots still ran (400 tokens each), not after a wait.
        assert resp.headers["Retry-After"] == "1" and ended < max(served)
        assert "request_limit.max_requests=2" in resp.json()["error"]["message"]
    # Slots are given back: once the load is gone, requests are served again.
    assert httpx.post(f"{limited_url}/v1/completions", json={**body, "max_tokens": 2}, timeout=60).status_code == 200
    assert httpx.get(f"{limited_url}/health", timeout=10).status_code == 200


def test_body_over_body_limit_is_413_naming_the_limit(limited_url):
    resp = httpx.post(f"{limited_url}/v1/completions", timeout=60,
                      json={"model": "pdserve-tiny", "prompt": "a" * (1024 * 1024 + 10)})
    assert resp.status_code == 413
    assert "request_limit.body_limit=1 MB" in resp.json()["error"]["message"]
