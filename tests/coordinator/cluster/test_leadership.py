"""Leadership on a FakeStore: one active, takeover when its lease goes, roles kept while etcd is away."""

from __future__ import annotations

from coordinator.cluster.leadership import Leadership, Role
from tests.coordinator.cluster.fake_store import FakeStore

KEY = "/p/leader"


def pair(store: FakeStore) -> tuple[Leadership, Leadership]:
    return Leadership(store, KEY, "A", 3), Leadership(store, KEY, "B", 3)


async def test_the_first_campaign_wins_and_the_other_waits_naming_the_leader():
    store = FakeStore()
    a, b = pair(store)
    await a.step()
    await b.step()
    assert (a.role, b.role) == (Role.ACTIVE, Role.STANDBY)
    assert (a.leader, b.leader) == ("A", "A") and a.serving and not b.serving
    assert a.interval_s() == 1 and b.interval_s() == 0.5  # ttl/3 to keep the key, ttl/6 to try for it


async def test_a_standby_takes_over_when_the_active_lease_expires():
    store = FakeStore()
    a, b = pair(store)
    await a.step()
    await b.step()
    store.expire(a._lease)  # A died: no refresh for a TTL
    await b.step()
    assert b.role is Role.ACTIVE
    await a.step()  # A comes back: its lease is gone and B holds the key
    assert a.role is Role.STANDBY and a.leader == "B"


async def test_an_active_whose_lease_lapsed_keeps_the_key_when_no_one_took_it():
    store = FakeStore()
    a, _ = pair(store)
    await a.step()
    store.expire(a._lease)
    await a.step()
    assert a.role is Role.ACTIVE and store.data[KEY].lease == a._lease


async def test_roles_hold_while_etcd_is_unreachable():
    store = FakeStore()
    a, b = pair(store)
    await a.step()
    await b.step()
    store.down = True
    for _ in range(3):
        await a.step()
        await b.step()
    assert (a.role, b.role) == (Role.ACTIVE, Role.STANDBY)


async def test_resigning_gives_the_key_up_at_once():
    store = FakeStore()
    a, b = pair(store)
    await a.step()
    await b.step()
    await a.resign()
    assert a.role is Role.STANDBY and KEY not in store.data
    await b.step()
    assert b.role is Role.ACTIVE


async def test_replicas_never_campaign():
    store = FakeStore()
    replica = Leadership(store, KEY, "R", 3, replicas=True)
    await replica.start()
    await replica.step()
    assert replica.role is Role.REPLICA and replica.serving and store.calls == []
