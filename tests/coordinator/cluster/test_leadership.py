"""Leadership on a FakeStore: one active, takeover when its lease goes, roles kept while etcd is away."""

from __future__ import annotations

import asyncio

from coordinator.cluster.etcd_store import EtcdUnavailable
from coordinator.cluster.leadership import Leadership, Role
from tests.coordinator.cluster.fake_store import FakeStore
from tests.helpers import wait_until

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


async def test_an_error_the_store_lets_through_costs_one_round_not_the_loop():
    store = FakeStore()
    a = Leadership(store, KEY, "A", 1)  # a round every 1/6 s while standby
    store.failures = [ValueError("a reply that is not JSON")]
    await a.start()  # its first round fails...
    assert a.role is Role.STANDBY and a._task is not None
    for _ in range(50):  # ...and the loop goes on: the next round wins the key
        if a.role is Role.ACTIVE:
            break
        await asyncio.sleep(0.05)
    assert a.role is Role.ACTIVE and not a._task.done()
    store.failures = [RuntimeError("anything")]  # an ACTIVE's refresh too: it keeps refreshing after
    await a.step()
    await a.step()
    assert a.role is Role.ACTIVE and store.calls[-1] == "refresh"
    await a.resign()
    assert KEY not in store.data


class GatedStore(FakeStore):
    """A create that commits at once but whose reply waits for `gate` (an etcd call on the store's thread)."""

    def __init__(self):
        super().__init__()
        self.gate = asyncio.Event()
        self.creating = asyncio.Event()

    async def create(self, key, value, lease=0):
        holder = await super().create(key, value, lease)
        self.creating.set()
        await self.gate.wait()
        return holder


async def start_creating(store: GatedStore) -> Leadership:
    """A standby whose loop's campaign is inside a create that has committed."""
    store.gate.set()
    b = Leadership(store, KEY, "B", 1)
    await b.step()
    a = Leadership(store, KEY, "A", 1)
    await a.start()
    assert a.role is Role.STANDBY
    store.gate.clear()
    store.creating.clear()
    store.expire(b._lease)  # B died: A's next round creates the key
    await asyncio.wait_for(store.creating.wait(), 5)
    return a


async def test_resigning_during_a_create_waits_for_it_and_gives_the_key_up():
    store = GatedStore()
    a = await start_creating(store)
    step = a._step
    resigning = asyncio.create_task(a.resign())
    await wait_until(lambda: a._task is None and a._step is None, what="resign() to take the step under way")
    # resign() has stopped the loop and holds the step, inside its create: it waits for it rather than cancel it
    assert not resigning.done() and not step.done()
    store.gate.set()
    await asyncio.wait_for(resigning, 5)
    assert a.role is Role.STANDBY and KEY not in store.data and store.leases == set()


async def test_resigning_waits_a_bounded_time_then_gives_the_create_lease_up():
    store = GatedStore()
    a = await start_creating(store)
    step = a._step
    a.resign_wait_s = 0.05
    await asyncio.wait_for(a.resign(), 5)  # the create's reply never comes in time
    assert a.role is Role.STANDBY and KEY not in store.data and store.leases == set()
    assert not step.done()
    store.gate.set()  # it comes late: a resigned coordinator does not lead
    await asyncio.wait_for(step, 30)  # the late create's step has run to its end
    assert a.role is Role.STANDBY and KEY not in store.data


async def test_a_create_whose_reply_was_lost_is_won_at_the_next_round():
    class LostReply(FakeStore):
        async def create(self, key, value, lease=0):
            await super().create(key, value, lease)
            raise EtcdUnavailable("create: timed out after it committed")

    store = LostReply()
    a, b = pair(store)
    await a.step()
    assert a.role is Role.STANDBY and KEY in store.data
    await a.step()  # the key holds this process's id: its own, on a lease it granted
    assert a.role is Role.ACTIVE and a._lease == store.data[KEY].lease and a.leader == "A"
    await b.step()
    assert b.role is Role.STANDBY and b.leader == "A"
    await a.step()
    assert a.role is Role.ACTIVE and store.calls[-1] == "refresh"


async def test_a_restarted_coordinator_takes_its_previous_runs_key_over_at_once():
    store = FakeStore()
    old = Leadership(store, KEY, "A", 3)
    await old.step()
    old_lease = old._lease
    new = Leadership(store, KEY, "A", 3)  # the same coordinator, restarted before its lease ran out
    await new.step()
    assert new.role is Role.ACTIVE and store.data[KEY].lease == new._lease != old_lease
    assert old_lease not in store.leases  # revoked, not just the key deleted
    b = Leadership(store, KEY, "B", 3)
    await b.step()
    assert b.role is Role.STANDBY and b.leader == "A"


async def test_two_live_coordinators_of_one_name_settle_on_one_active():
    store = FakeStore()
    first, second = Leadership(store, KEY, "A", 3), Leadership(store, KEY, "A", 3)
    await first.step()
    await second.step()  # takes the key as a previous run's: the first's refresh then fails
    for _ in range(5):
        await first.step()
        await second.step()
        assert (first.role, second.role) == (Role.STANDBY, Role.ACTIVE)  # no taking it back in turn
    assert store.data[KEY].lease == second._lease
