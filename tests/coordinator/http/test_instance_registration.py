"""Workers started with --coordinator join, are taken out when silent, and leave on SIGTERM."""

from __future__ import annotations

import pytest

import signal

import httpx

from tests.helpers import instance_states, management_url, start_coordinator, start_worker, wait_for, write_config

pytestmark = pytest.mark.system

HEALTH = {"health_config": {"check_interval_s": 0.3, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.5}}


def test_registered_workers_serve_requests_and_leave_on_sigterm(model_dir, tmp_path):
    coordinator = start_coordinator(write_config(tmp_path / "ms_coordinator.json", [], [], model_dir, HEALTH))
    manage = management_url(coordinator)
    prefill = start_worker("prefill", model_dir, "--coordinator", manage)
    decode = start_worker("decode", model_dir, "--coordinator", manage, "--drain-seconds", "5")
    try:
        wait_for(lambda: instance_states(coordinator) == {"prefill": {prefill.address: "healthy"},
                                                          "decode": {decode.address: "healthy"}},
                 what="both workers registered")
        listed = httpx.get(f"{manage}/v1/instances", timeout=5).json()["decode"][0]
        assert listed["source"] == "registered" and listed["reported"]["kv_capacity_tokens"] > 0
        resp = httpx.post(f"{coordinator.address}/v1/completions", timeout=60, json={
            "model": "pdserve-tiny", "prompt": "Hello", "max_tokens": 4})
        assert resp.status_code == 200, resp.text
        assert decode.stop() == 0
        wait_for(lambda: instance_states(coordinator)["decode"] == {}, what="the decode worker deregistered")
        resp = httpx.post(f"{coordinator.address}/v1/completions", timeout=60, json={
            "model": "pdserve-tiny", "prompt": "Hello", "max_tokens": 4})
        assert resp.status_code == 503 and "no decode instance" in resp.json()["error"]["message"]
        assert httpx.get(f"{coordinator.address}/health", timeout=10).status_code == 503
    finally:
        for proc in (decode, prefill, coordinator):
            proc.stop()


def test_a_silent_worker_is_taken_out_and_put_back_when_it_returns(model_dir, tmp_path):
    coordinator = start_coordinator(write_config(tmp_path / "ms_coordinator.json", [], [], model_dir, HEALTH))
    manage = management_url(coordinator)
    prefill = start_worker("prefill", model_dir, "--coordinator", manage)
    decode = start_worker("decode", model_dir, "--coordinator", manage)
    try:
        wait_for(lambda: instance_states(coordinator)["decode"] == {decode.address: "healthy"}, what="registered")
        decode.proc.send_signal(signal.SIGSTOP)
        wait_for(lambda: instance_states(coordinator)["decode"][decode.address] == "unhealthy", what="taken out")
        assert httpx.get(f"{coordinator.address}/health", timeout=10).status_code == 503
        decode.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: instance_states(coordinator)["decode"][decode.address] == "healthy", what="put back")
        resp = httpx.post(f"{coordinator.address}/v1/completions", timeout=60, json={
            "model": "pdserve-tiny", "prompt": "Hello", "max_tokens": 4})
        assert resp.status_code == 200, resp.text
    finally:
        decode.proc.send_signal(signal.SIGCONT)
        for proc in (decode, prefill, coordinator):
            proc.stop()


def test_management_api_rejects_bad_registrations_clearly(cluster, tmp_path):
    coordinator = start_coordinator(write_config(tmp_path / "ms_coordinator.json", [cluster.prefill.address],
                                                 [cluster.decode.address], cluster.model_dir))
    manage = management_url(coordinator)
    try:
        resp = httpx.post(f"{manage}/v1/instances/register", json={"role": "router", "address": "h:1"})
        assert resp.status_code == 400 and "role" in resp.json()["error"]["message"]
        resp = httpx.post(f"{manage}/v1/instances/register", json={"role": "decode", "address": "nohost"})
        assert resp.status_code == 400 and "host:port" in resp.json()["error"]["message"]
        resp = httpx.post(f"{manage}/v1/instances/heartbeat", json={"role": "decode", "address": "h:1"})
        assert resp.status_code == 404 and "register again" in resp.json()["error"]["message"]
    finally:
        coordinator.stop()
