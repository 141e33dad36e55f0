"""SharedHealth on a FakeStore: a verdict of one coordinator taken up by another."""

from __future__ import annotations

import json

from coordinator.cluster.shared_health import SharedHealth
from coordinator.workers.instances import InstanceRegistry, InstanceState
from tests.coordinator.cluster.fake_store import FakeStore

ADDRESS = "w:1"


def coordinator(store: FakeStore, name: str, lease: int) -> tuple[InstanceRegistry, SharedHealth]:
    registry = InstanceRegistry()
    registry.register("decode", ADDRESS)
    return registry, SharedHealth(store, registry, "/p", name, lambda role, address: lease)


async def test_an_unhealthy_verdict_of_another_coordinator_takes_the_worker_out():
    store = FakeStore()
    lease = await store.grant(3)
    a_registry, a = coordinator(store, "A", lease)
    b_registry, b = coordinator(store, "B", lease)
    await a.exchange()
    await b.exchange()  # the first read is the baseline
    a_registry.record_failure(a_registry.get("decode", ADDRESS), "health check failed: UNAVAILABLE", gone=True)
    await a.exchange()
    verdict = json.loads(store.data["/p/health/decode/w:1"].value)
    assert (verdict["state"], verdict["by"], store.data["/p/health/decode/w:1"].lease) == ("unhealthy", "A", lease)
    await b.exchange()
    instance = b_registry.get("decode", ADDRESS)
    assert instance.state is InstanceState.UNHEALTHY
    assert instance.reason == "reported unhealthy by A: health check failed: UNAVAILABLE"
    revision = store.data["/p/health/decode/w:1"].mod_revision
    await b.exchange()  # an adopted verdict is not published again
    assert store.data["/p/health/decode/w:1"].mod_revision == revision


async def test_verdicts_older_than_the_coordinator_and_its_own_are_not_adopted():
    store = FakeStore()
    lease = await store.grant(3)
    await store.put("/p/health/decode/w:1", json.dumps({"state": "unhealthy", "reason": "old", "by": "A", "at": 0}), lease)
    registry, b = coordinator(store, "B", lease)
    await b.exchange()
    assert registry.get("decode", ADDRESS).available
    await store.put("/p/health/decode/w:1", json.dumps({"state": "unhealthy", "reason": "x", "by": "B", "at": 1}), lease)
    await b.exchange()
    assert registry.get("decode", ADDRESS).available


async def test_a_worker_own_checks_bring_back_is_published_healthy():
    store = FakeStore()
    lease = await store.grant(3)
    registry, a = coordinator(store, "A", lease)
    instance = registry.get("decode", ADDRESS)
    registry.record_failure(instance, "health check failed", gone=True)
    await a.exchange()
    registry.record_health(instance, instance.reported, draining=False)
    await a.exchange()
    assert json.loads(store.data["/p/health/decode/w:1"].value)["state"] == "healthy"
    puts = store.calls.count("put")
    await a.exchange()
    assert store.calls.count("put") == puts  # nothing changed: nothing written


async def test_a_verdict_made_before_the_workers_lease_is_known_is_published_once_it_is():
    store = FakeStore()
    leases = {"lease": 0}  # just registered: not read back from etcd yet
    registry = InstanceRegistry()
    registry.register("decode", ADDRESS)
    a = SharedHealth(store, registry, "/p", "A", lambda role, address: leases["lease"])
    registry.record_failure(registry.get("decode", ADDRESS), "health check failed", gone=True)
    await a.exchange()
    assert "/p/health/decode/w:1" not in store.data
    leases["lease"] = await store.grant(3)  # the registry sync read it back
    await a.exchange()
    assert json.loads(store.data["/p/health/decode/w:1"].value)["state"] == "unhealthy"


async def test_the_exchange_outlives_an_error_the_store_lets_through():
    store = FakeStore()
    lease = await store.grant(3)
    registry, a = coordinator(store, "A", lease)
    registry.record_failure(registry.get("decode", ADDRESS), "health check failed", gone=True)
    store.failures = [ValueError("a reply that is not JSON")]
    await a.exchange()  # logged, not raised
    await a.exchange()  # and the change is still published
    assert json.loads(store.data["/p/health/decode/w:1"].value)["state"] == "unhealthy"
