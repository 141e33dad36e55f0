"""request_limit.max_running: the rest wait in the coordinator, highest priority first, each
within its own timeout."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.helpers import BackgroundStream, scrape, start_coordinator, write_config

pytestmark = pytest.mark.system

BLOCKER = {"model": "pdserve-tiny", "prompt": "Hello", "max_tokens": 1500, "stream": True, "temperature": 0,
           "ignore_eos": True}


@pytest.fixture
def one_at_a_time(cluster, tmp_path):
    coordinator = start_coordinator(write_config(
        tmp_path / "ms_coordinator.json", [cluster.prefill.address], [cluster.decode.address], cluster.model_dir,
        sections={"request_limit": {"max_running": 1}}, maxIterTimes=1500, maxSeqLen=2048,
        maxInputTokenLen=2048))
    yield coordinator
    coordinator.stop()


def mindie(url: str, results: dict, name: str, **parameters) -> threading.Thread:
    def run():
        resp = httpx.post(f"{url}/infer", timeout=120, json={
            "inputs": "Hi", "parameters": {"max_new_tokens": 2, **parameters}})
        results[name] = (resp.status_code, time.monotonic(), resp.json())
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def wait_until_waiting(url: str, count: int) -> None:
    deadline = time.monotonic() + 20
    while scrape(url)[("pdserve_requests_waiting", ())] != count:
        assert time.monotonic() < deadline, "requests never queued"
        time.sleep(0.02)


def test_waiting_requests_run_by_priority_then_arrival(one_at_a_time, cluster):
    url = one_at_a_time.address
    blocker = BackgroundStream(f"{url}/v1/completions", BLOCKER)
    assert blocker.first_chunk.wait(30)
    results: dict = {}
    threads = []
    for name, priority in (("low", 5), ("mid", 3), ("high", 1), ("high-later", 1)):
        threads.append(mindie(url, results, name, priority=priority))
        wait_until_waiting(url, len(threads))
    during = scrape(url)
    assert during[("pdserve_instance_outstanding_requests", (("address", cluster.decode.address),
                                                             ("role", "decode")))] == 1  # only the blocker runs
    blocker.join(60)
    for thread in threads:
        thread.join(60)
    assert all(status == 200 for status, _, _ in results.values()), results
    order = sorted(results, key=lambda name: results[name][1])
    assert order == ["high", "high-later", "mid", "low"]
    metrics = scrape(url)
    assert metrics[("pdserve_requests_waiting", ())] == 0
    assert metrics[("pdserve_request_queue_time_seconds_count", ())] >= 5


def test_a_request_whose_timeout_passes_in_the_queue_gets_504(one_at_a_time):
    url = one_at_a_time.address
    blocker = BackgroundStream(f"{url}/v1/completions", BLOCKER)
    assert blocker.first_chunk.wait(30)
    resp = httpx.post(f"{url}/infer", timeout=60, json={
        "inputs": "Hi", "parameters": {"max_new_tokens": 2, "timeout": 0.5}})
    assert resp.status_code == 504
    assert "queue" in resp.json()["error"]
    assert blocker.ended_at is None  # answered at its own timeout, while the one running still ran
    blocker.join(60)
    assert scrape(url)[("pdserve_requests_failed_total", (("api", "mindie"), ("reason", "timeout")))] == 1
    # Nothing was lost: the line moves on.
    assert httpx.post(f"{url}/infer", timeout=60, json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}
                      ).status_code == 200
