"""RegistrySync on a FakeStore: two coordinators sharing workers, leases running out, etcd going away."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.cluster.registry_sync import LocalView, RegistrySync, WorkerRecord, plan_sync
from coordinator.workers.instances import InstanceRegistry, InstanceState
from tests.coordinator.cluster.fake_store import FakeStore
from tests.helpers import wait_until

TTL = 3.0


def record(address: str, digest: str = "d1", at: float = 1.0) -> WorkerRecord:
    return WorkerRecord("decode", address, "", digest, at)


def test_a_read_learns_new_keys_and_drops_vanished_ones():
    previous = {"k/a": record("a:1"), "k/b": record("b:1")}
    listed = {"k/b": record("b:1"), "k/c": record("c:1")}
    plan = plan_sync(previous, listed, lambda role, address: LocalView("d1", 1.0) if address == "b:1" else None)
    assert plan.learned == [record("c:1")]
    assert plan.vanished == [("decode", "a:1")]
    assert plan.updated == []


def test_the_newer_registration_of_a_worker_wins():
    listed = {"k": record("a:1", digest="new", at=5.0)}
    assert plan_sync({}, listed, lambda *_: LocalView("old", 1.0)).updated == [listed["k"]]
    assert plan_sync({}, listed, lambda *_: LocalView("mine", 9.0)).updated == []  # registered here since


def test_a_worker_not_yet_in_etcd_is_not_vanished():
    assert plan_sync({}, {}, lambda *_: LocalView("d1", 1.0)).vanished == []


def test_a_record_holds_the_credentials_digest_and_round_trips():
    r = record("a:1", digest="ab" * 32)
    assert WorkerRecord.from_json(r.to_json().encode()) == r
    assert set(r.__dict__) == {"role", "address", "metrics_url", "credential_sha256", "registered_at"}


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Coordinator:
    """A registry and its sync, as one coordinator holds them."""

    def __init__(self, store: FakeStore, clock: Clock):
        self.registry = InstanceRegistry(heartbeat_timeout_s=TTL, clock=clock)
        self.forgotten: list[str] = []

        async def forget(instance):
            self.forgotten.append(instance.address)

        self.sync = RegistrySync(store, self.registry, "/p", TTL, on_forget=forget, clock=clock)

    async def register(self, address: str, digest: str = "d1"):
        instance = self.registry.register("decode", address)
        instance.credential = digest
        self.sync.registered(instance)
        await self.sync.flush()
        return instance


@pytest.fixture
def world():
    store, clock = FakeStore(), Clock()
    return store, clock, Coordinator(store, clock), Coordinator(store, clock)


async def test_a_worker_registered_through_one_coordinator_is_routed_to_by_another(world):
    store, _, a, b = world
    await a.register("w:1", digest="ab")
    learned = await b.sync.sync_once()
    assert [i.address for i in learned] == ["w:1"]
    instance = b.registry.get("decode", "w:1")
    assert instance.registered and instance.credential == "ab" and instance.available


async def test_a_worker_whose_lease_expires_leaves_every_coordinator(world):
    store, clock, a, b = world
    await a.register("w:1")
    await a.sync.sync_once()
    await b.sync.sync_once()
    store.expire(store.data["/p/instances/decode/w:1"].lease)
    await b.sync.sync_once()
    assert b.registry.get("decode", "w:1") is None and b.forgotten == ["w:1"]
    # A heard the worker itself within the TTL: it puts the key back rather than drop a live worker...
    await a.sync.sync_once()
    await a.sync.flush()
    assert "/p/instances/decode/w:1" in store.data and a.registry.get("decode", "w:1") is not None
    # ...until its heartbeats are older than the TTL.
    await a.sync.sync_once()
    clock.now += TTL + 1
    store.expire(store.data["/p/instances/decode/w:1"].lease)
    await a.sync.sync_once()
    assert a.registry.get("decode", "w:1") is None and a.forgotten == ["w:1"]


async def test_a_heartbeat_through_any_coordinator_refreshes_the_lease(world):
    store, _, a, b = world
    await a.register("w:1")
    await b.sync.sync_once()
    lease = store.data["/p/instances/decode/w:1"].lease
    b.sync.heartbeat(b.registry.get("decode", "w:1"))
    await b.sync.flush()
    assert store.calls[-2:] == ["get", "refresh"] and store.data["/p/instances/decode/w:1"].lease == lease
    store.expire(lease)  # lapsed all the same: the heartbeat proves the worker alive, so it is put back
    b.sync.heartbeat(b.registry.get("decode", "w:1"))
    await b.sync.flush()
    assert store.data["/p/instances/decode/w:1"].lease not in (0, lease)


async def test_deregistration_through_any_coordinator_deletes_the_key(world):
    store, _, a, b = world
    await a.register("w:1")
    await b.sync.sync_once()
    b.registry.deregister("decode", "w:1")
    b.sync.deregistered("decode", "w:1")
    await b.sync.flush()
    assert store.data == {}
    await a.sync.sync_once()  # A had not read it yet: nothing to drop, and it is still local
    assert a.registry.get("decode", "w:1") is not None


async def test_etcd_down_drops_no_worker(world):
    store, clock, a, b = world
    await a.register("w:1")
    await b.sync.sync_once()
    store.down = True
    for _ in range(5):
        clock.now += TTL
        assert await b.sync.sync_once() == []
        assert b.registry.expire_heartbeats() == []
    instance = b.registry.get("decode", "w:1")
    assert instance.state is InstanceState.HEALTHY and not store.reachable


async def test_registrations_during_an_outage_reach_the_others_when_etcd_returns(world):
    store, _, a, b = world
    await a.register("w:1")
    await b.sync.sync_once()
    store.down = True
    await a.sync.sync_once()  # finds etcd gone
    await a.register("late:1")
    a.registry.deregister("decode", "w:1")
    a.sync.deregistered("decode", "w:1")
    await a.sync.flush()
    store.down = False
    await a.sync.sync_once()  # etcd answers: resync (deletion replayed, every registered worker put again)
    await a.sync.flush()
    assert set(store.data) == {"/p/instances/decode/late:1"}
    await b.sync.sync_once()  # B's first read after the outage takes what is new...
    assert b.registry.get("decode", "late:1") is not None
    await b.sync.sync_once()  # ...and its next one drops what is gone
    assert b.registry.get("decode", "w:1") is None and b.forgotten == ["w:1"]


async def test_an_etcd_that_lost_its_data_drops_nothing_before_the_workers_coordinator_resyncs(world):
    store, _, a, b = world
    await a.register("w:1")
    await b.sync.sync_once()
    store.down = True
    await b.sync.sync_once()
    store.down = False
    store.data.clear()
    await b.sync.sync_once()  # empty: but the worker's own coordinator has not put it back yet
    assert b.registry.get("decode", "w:1") is not None
    await a.sync.sync_once()  # A heard the worker: its resync puts it back
    await a.sync.flush()
    await b.sync.sync_once()
    assert b.registry.get("decode", "w:1") is not None and b.forgotten == []


async def test_the_writer_outlives_an_error_the_store_lets_through(world):
    store, _, a, _ = world
    await a.sync.start()
    try:
        store.failures = [ValueError("a reply that is not JSON")]
        for address in ("w:1", "w:2"):  # the first write fails: the second still goes out
            instance = a.registry.register("decode", address)
            a.sync.registered(instance)
        for _ in range(50):
            if "/p/instances/decode/w:2" in store.data:
                break
            await asyncio.sleep(0.01)
        assert set(store.data) == {"/p/instances/decode/w:2"}
        store.failures = [RuntimeError("anything")]
        a.sync.heartbeat(a.registry.get("decode", "w:2"))  # fails in the writer's next round...
        await wait_until(lambda: not store.failures, what="the writer's round to meet the failure")
        a.sync.registered(a.registry.get("decode", "w:1"))  # ...which goes on writing after it
        for _ in range(50):
            if "/p/instances/decode/w:1" in store.data:
                break
            await asyncio.sleep(0.01)
        assert "/p/instances/decode/w:1" in store.data and not a.sync._writer.done()
    finally:
        await a.sync.stop()


async def test_etcd_down_a_restarted_worker_may_register_again_once_heartbeats_lapse(world):
    store, clock, a, b = world
    await a.register("w:1")
    await b.sync.sync_once()
    assert b.sync.heartbeating("decode", "w:1")  # its lease is alive: a second registration is refused
    store.down = True
    await b.sync.sync_once()
    clock.now += TTL - 1
    await b.sync.sync_once()
    assert b.sync.heartbeating("decode", "w:1")  # within heartbeat_timeout_s of the last read
    clock.now += 2
    await b.sync.sync_once()
    assert not b.sync.heartbeating("decode", "w:1")  # no proof since: the address is free, as without etcd
    assert b.registry.get("decode", "w:1").available and b.registry.expire_heartbeats() == []  # still routed to
    # Heartbeats heard through this coordinator are proof though.
    b.registry.heartbeat("decode", "w:1")
    b.sync.heartbeat(b.registry.get("decode", "w:1"))
    assert b.sync.heartbeating("decode", "w:1")
    clock.now += TTL
    assert not b.sync.heartbeating("decode", "w:1")
    assert not b.sync.heartbeating("decode", "unknown:1")
