"""A KV transfer that stalls: the decode worker's receive timeout fires, both workers free the KV,
and the request is retried on another prefill instance instead of hanging."""

from __future__ import annotations

import pytest

import signal
import time

import grpc
import httpx

from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from tests.helpers import CLUSTER_KV_TIMEOUT_S, scrape, start_coordinator, start_worker, write_config

pytestmark = pytest.mark.system


def kv_used(address: str, role: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.PrefillServiceStub(channel) if role == "prefill" else pb_grpc.DecodeServiceStub(channel)
        return stub.Health(pb.HealthRequest(), timeout=5).kv_used_tokens


def test_a_stalled_prefill_worker_costs_one_kv_timeout_then_the_request_succeeds_elsewhere(cluster, tmp_path):
    stalled = start_worker("prefill", cluster.model_dir)
    coordinator = start_coordinator(write_config(tmp_path / "ms_coordinator.json",
                                                 [stalled.address, cluster.prefill.address],
                                                 [cluster.decode.address], cluster.model_dir))
    stalled.proc.send_signal(signal.SIGSTOP)
    try:
        for _ in range(2):  # round robin sends one of the two to the stalled worker
            started = time.monotonic()
            resp = httpx.post(f"{coordinator.address}/v1/completions", timeout=60, json={
                "model": "pdserve-tiny", "prompt": "Hello", "max_tokens": 3})
            assert resp.status_code == 200, resp.text
            assert time.monotonic() - started < CLUSTER_KV_TIMEOUT_S + 10
        # Each request the stalled worker got was retried: after the decode worker's KV receive timeout,
        # or sooner when the silence watch declared the worker lost (tests/coordinator/workers/test_silent_workers.py).
        assert scrape(coordinator.address)[("pdserve_prefill_retries_total", ())] >= 1
        assert kv_used(cluster.decode.address, "decode") == 0
        stalled.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 20
        while kv_used(stalled.address, "prefill") != 0:  # its lease ended when the request moved on
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        stalled.proc.send_signal(signal.SIGCONT)
        stalled.stop()
        coordinator.stop()
