"""A prefill worker that died is skipped: requests are retried on another instance, invisibly,
and the dead one is taken out of rotation at once."""

from __future__ import annotations

import pytest

import signal

import httpx

from tests.helpers import instance_states, scrape, start_coordinator, start_worker, write_config

pytestmark = pytest.mark.system


def test_requests_routed_to_a_dead_prefill_worker_are_retried_on_a_live_one(cluster, tmp_path):
    doomed = start_worker("prefill", cluster.model_dir)
    doomed.proc.send_signal(signal.SIGKILL)
    doomed.proc.wait()
    coordinator = start_coordinator(write_config(tmp_path / "ms_coordinator.json",
                                                 [doomed.address, cluster.prefill.address],
                                                 [cluster.decode.address], cluster.model_dir))
    try:
        for stream in (False, True, False, True):
            resp = httpx.post(f"{coordinator.address}/v1/completions", timeout=60, json={
                "model": "pdserve-tiny", "prompt": "Hello", "max_tokens": 3, "stream": stream})
            assert resp.status_code == 200, resp.text
            assert '"error":' not in resp.text  # a late error frame; success carries "error_info": null
        # The first request found it dead and retried; its circuit opened, so no later request went there.
        assert scrape(coordinator.address)[("pdserve_prefill_retries_total", ())] == 1
        assert instance_states(coordinator)["prefill"] == {doomed.address: "unhealthy",
                                                           cluster.prefill.address: "healthy"}
    finally:
        coordinator.stop()


def test_with_no_live_prefill_worker_the_request_fails_clearly(cluster, tmp_path):
    doomed = start_worker("prefill", cluster.model_dir)
    doomed.proc.send_signal(signal.SIGKILL)
    doomed.proc.wait()
    coordinator = start_coordinator(write_config(tmp_path / "ms_coordinator.json", [doomed.address],
                                                 [cluster.decode.address], cluster.model_dir))
    try:
        resp = httpx.post(f"{coordinator.address}/v1/completions", timeout=60, json={
            "model": "pdserve-tiny", "prompt": "Hello", "max_tokens": 3})
        assert resp.status_code == 503
        assert f"prefill worker {doomed.address} failed: UNAVAILABLE" in resp.json()["error"]["message"]
    finally:
        coordinator.stop()
