"""ReplicaCensus: each replica's leased key, counted every round; a lost lease or a failed put is made good."""

from __future__ import annotations

from coordinator.cluster.etcd_store import EtcdUnavailable
from coordinator.cluster.replica_census import ReplicaCensus
from tests.coordinator.cluster.fake_store import FakeStore


async def test_replicas_count_each_other_and_tell_the_count_when_it_changes():
    store = FakeStore()
    told: list[int] = []
    first, second = ReplicaCensus(store, "/p", "a", 3), ReplicaCensus(store, "/p", "b", 3)
    first.on_count = told.append
    await first.round()
    assert first.count == 1 and told == []  # alone, as it started
    await second.round()
    await first.round()
    assert first.count == 2 and told == [2]
    await second.leave()
    await first.round()
    assert first.count == 1 and told == [2, 1]


async def test_a_lost_lease_or_a_failed_put_is_written_again_next_round():
    store = FakeStore()
    census = ReplicaCensus(store, "/p", "a", 3)
    await census.round()
    store.expire(census._lease)  # cut off from etcd for longer than the lease
    await census.round()
    assert "/p/replicas/a" in store.data
    store.expire(census._lease)
    calls = len(store.calls)
    original_put = store.put

    async def failing_put(key, value, lease=0):
        store.put = original_put
        raise EtcdUnavailable("put: down")

    store.put = failing_put
    await census.round()  # the key is not written: the lease is not kept
    assert "/p/replicas/a" not in store.data and census._lease == 0 and len(store.calls) > calls
    await census.round()
    assert "/p/replicas/a" in store.data and census.count == 1


async def test_etcd_unreachable_keeps_the_last_count():
    store = FakeStore()
    census = ReplicaCensus(store, "/p", "a", 3)
    await ReplicaCensus(store, "/p", "b", 3).round()
    await census.round()
    store.down = True
    await census.round()
    assert census.count == 2
