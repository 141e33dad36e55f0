"""The instance registry: registration, heartbeats and the circuit breaker."""

from __future__ import annotations

import pytest

from coordinator.workers.instances import InstanceRegistry, InstanceState, ReportedLoad
from tests.helpers import FakeClock


def test_repeated_failures_open_the_circuit_and_a_passing_check_closes_it():
    registry = InstanceRegistry(["p:1"], ["d:1"], failure_threshold=3)
    decode = registry.get("decode", "d:1")
    registry.record_failure(decode, "boom")
    registry.record_failure(decode, "boom")
    assert decode.available
    registry.record_failure(decode, "boom")
    assert decode.state is InstanceState.UNHEALTHY and registry.available("decode") == []
    registry.record_health(decode, ReportedLoad(num_running=1), draining=False)
    assert decode.available and decode.consecutive_failures == 0 and decode.reported.num_running == 1


def test_a_health_check_that_did_not_read_the_load_closes_the_circuit_and_keeps_the_last_load():
    registry = InstanceRegistry(["p:1"], ["d:1"], failure_threshold=1)
    decode = registry.get("decode", "d:1")
    registry.record_health(decode, ReportedLoad(num_running=2), draining=False)
    registry.record_failure(decode, "boom")
    registry.record_health(decode, None, draining=False)
    assert decode.available and decode.reported.num_running == 2


def test_a_success_resets_the_failure_count():
    registry = InstanceRegistry(["p:1"], ["d:1"], failure_threshold=2)
    decode = registry.get("decode", "d:1")
    registry.record_failure(decode, "boom")
    registry.record_success(decode)
    registry.record_failure(decode, "boom")
    assert decode.available


def test_an_unreachable_worker_is_taken_out_at_once():
    registry = InstanceRegistry(["p:1"], ["d:1"], failure_threshold=5)
    registry.record_failure(registry.get("prefill", "p:1"), "UNAVAILABLE", gone=True)
    assert registry.available("prefill") == []


def test_a_draining_worker_gets_no_new_requests():
    registry = InstanceRegistry(["p:1"], ["d:1"])
    registry.record_health(registry.get("decode", "d:1"), ReportedLoad(), draining=True)
    assert registry.get("decode", "d:1").state is InstanceState.DRAINING
    assert registry.available("decode") == []


def test_a_registered_worker_that_misses_heartbeats_is_taken_out_then_back_then_forgotten():
    clock = FakeClock()
    registry = InstanceRegistry(heartbeat_timeout_s=10, forget_after_s=60, clock=clock)
    registry.register("decode", "d:1")
    clock.now += 11
    registry.expire_heartbeats()
    decode = registry.get("decode", "d:1")
    assert decode.state is InstanceState.UNHEALTHY and decode.reason == "missed heartbeats"
    registry.record_health(decode, ReportedLoad(), draining=False)
    assert not decode.available  # answering health checks is not enough while heartbeats are missing
    assert registry.heartbeat("decode", "d:1")
    assert decode.available
    clock.now += 61
    assert registry.expire_heartbeats() == [decode]
    assert registry.get("decode", "d:1") is None
    assert not registry.heartbeat("decode", "d:1")  # unknown now: the worker must register again


def test_deregistered_workers_are_forgotten_and_configured_ones_need_no_heartbeat():
    clock = FakeClock()
    registry = InstanceRegistry(["p:1"], [], heartbeat_timeout_s=1, clock=clock)
    registry.register("decode", "d:1")
    assert registry.deregister("decode", "d:1")
    clock.now += 1000
    registry.expire_heartbeats()
    assert registry.available("prefill")[0].address == "p:1"
    assert registry.instances("decode") == []


def test_a_lease_counts_the_work_on_an_instance_and_a_normal_end_is_a_success():
    registry = InstanceRegistry(["p:1"], ["d:1"], failure_threshold=2)
    prefill = registry.get("prefill", "p:1")
    registry.record_failure(prefill, "boom")
    with registry.lease(prefill, prompt_tokens=100) as leased:
        assert leased is prefill
        assert (prefill.outstanding_requests, prefill.outstanding_prompt_tokens, prefill.num_served) == (1, 100, 1)
    assert (prefill.outstanding_requests, prefill.outstanding_prompt_tokens, prefill.num_served) == (0, 0, 1)
    assert prefill.consecutive_failures == 0


def test_a_lease_ended_by_an_error_gives_the_work_back_but_is_no_success():
    registry = InstanceRegistry(["p:1"], ["d:1"], failure_threshold=2)
    decode = registry.get("decode", "d:1")
    registry.record_failure(decode, "boom")
    with pytest.raises(RuntimeError), registry.lease(decode):
        raise RuntimeError("stream broke")
    assert decode.outstanding_requests == 0 and decode.consecutive_failures == 1
