"""Leadership: which coordinator serves the clients, decided by one key in etcd (mode active_standby).

A coordinator's life in active_standby:
  1. It starts as STANDBY: its predict port answers 503 with Retry-After: 1 until it knows it leads.
  2. Campaign: when `{prefix}/leader` is free it grants a lease of lease_ttl_s and creates the key (its
     name, and the id of this process) on that lease in one create-if-absent transaction. Whoever's create
     succeeds is ACTIVE; the others learn the holder from the same transaction and stay STANDBY. A key
     written by this process whose create's reply was lost is taken as won; a key of this coordinator's name
     written by another process (a previous run of it) is taken over at once (`_take_over` says how).
  3. ACTIVE: it refreshes its lease every ttl/3. If etcd answers that the lease is gone (this coordinator
     was cut off from etcd for longer than the TTL), it campaigns again at once: it stays ACTIVE if the key
     is free, and steps down to STANDBY if another coordinator holds it.
  4. STANDBY: it campaigns every ttl/6, so it takes over within about ttl + ttl/6 of the active's death
     (whose lease then expires), and at once after the active steps down (whose lease is then revoked).
  5. etcd unreachable: each keeps its role. The active serves from what it knows; a standby waits.
  6. Stop (SIGTERM): an ACTIVE coordinator revokes its lease first, so a standby takes over while it drains.
     A campaign under way is let finish first (its create may be running on the store's thread), so that a
     key it creates is given up too, never left to expire.
In mode replicas nothing is campaigned for: every coordinator is a REPLICA and serves.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
import uuid

from coordinator.cluster.etcd_store import EtcdError, EtcdStore, EtcdUnavailable

logger = logging.getLogger(__name__)


class Role(enum.Enum):
    ACTIVE = "active"  # holds the leader key: serves clients
    STANDBY = "standby"  # waits for the leader key: answers clients 503
    REPLICA = "replica"  # mode replicas: serves clients beside the others


class Leadership:
    """This coordinator's role, kept current by campaigning for (or holding) the leader key."""

    def __init__(self, store: EtcdStore, key: str, name: str, ttl_s: int, replicas: bool = False):
        self.store = store
        self.key = key
        self.name = name
        self.ttl_s = ttl_s
        self.role = Role.REPLICA if replicas else Role.STANDBY
        self.leader = name if replicas else ""  # the holder of the leader key, as last seen
        self.resign_wait_s = float(ttl_s)  # how long resign() waits for a campaign under way
        self._id = uuid.uuid4().hex  # this process, in the key's value: tells its own key from a previous run's
        self._lease = 0  # the lease the leader key is on while ACTIVE
        self._granted = 0  # a lease granted for a create whose outcome is not known yet
        self._held = False  # whether this process has held the key
        self._stopping = False  # resign() was called: never lead again
        self._warned_twin = False
        self._task: asyncio.Task | None = None
        self._step: asyncio.Task | None = None  # the loop's step under way

    @property
    def serving(self) -> bool:
        """Whether this coordinator serves client requests now."""
        return self.role is not Role.STANDBY

    def _become(self, role: Role, why: str) -> None:
        if role is not self.role:
            logger.warning("coordinator %s is now %s: %s", self.name, role.value, why)
            self.role = role

    async def campaign(self) -> None:
        """One try for the leader key: ACTIVE if this coordinator gets it, else STANDBY naming the holder."""
        holder = await self.store.get(self.key)
        if holder is not None and self._is_previous_run(holder):
            await self._take_over(holder)
            holder = await self.store.get(self.key)
        if holder is None:
            lease = await self.store.grant(self.ttl_s)
            self._granted = lease  # until the create's outcome is known: resign() revokes it
            value = json.dumps({"name": self.name, "id": self._id, "since": time.time()})
            holder = await self.store.create(self.key, value, lease)
            if holder is None:
                await self._won(lease)
                return
            self._granted = 0
            await self.store.revoke(lease)
        if _field(holder.value, "id") == self._id:
            # This process's own create landed though its reply was lost (EtcdUnavailable, or a create still on
            # its way when the last one gave up): the key is on a lease granted here, so hold it on that lease.
            await self._won(holder.lease)
            return
        self._lease, self.leader = 0, _name_of(holder.value)
        if self.leader == self.name and not self._warned_twin:
            self._warned_twin = True
            logger.error("another coordinator is also named %s and holds %s: give each coordinator its own "
                         "backup_config.coordinator_name", self.name, self.key)
        self._become(Role.STANDBY, f"{self.leader} holds {self.key}")

    async def _won(self, lease: int) -> None:
        if self._stopping:  # resign() came while the create was under way: give the key straight back
            self._granted = lease
            await self.store.revoke(lease)
            self._granted = 0
            return
        self._lease, self._granted, self.leader, self._held = lease, 0, self.name, True
        self._become(Role.ACTIVE, f"it holds {self.key}")

    def _is_previous_run(self, holder) -> bool:
        """The key names this coordinator but another process wrote it: a previous run of this coordinator
        (restarted before its lease ran out), unless this process has held the key itself, in which case the
        writer is a live twin of the same name (a misconfiguration) and is left alone (see _take_over)."""
        return (holder.lease != 0 and not self._held and _name_of(holder.value) == self.name
                and _field(holder.value, "id") != self._id)

    async def _take_over(self, holder) -> None:
        """Free a key left by a previous run of this coordinator, so this one campaigns at once instead of
        standing by for up to a TTL with itself named as the leader.

        The safe way is to revoke the lease the key was read on, not to delete the key (even conditionally on
        its mod revision): revoking touches only the keys on that lease, i.e. the key as read (one created
        since, by anyone, is on another lease and untouched; a lease gone meanwhile is a refusal, ignored);
        and should its writer in fact be alive (a second coordinator given the same name), its next refresh
        fails and it campaigns again, so it cannot go on believing it leads, as it would if the key were
        deleted under its still-living lease. That twin then finds the key under its own name but written by
        another process after it has held the key itself, so it stands by rather than take it back: the two
        settle on one active instead of taking the key from each other in turn."""
        logger.warning("coordinator %s: %s was left by a previous run of it (lease %x); revoking that lease to "
                       "campaign at once", self.name, self.key, holder.lease)
        try:
            await self.store.revoke(holder.lease)
        except EtcdUnavailable:
            raise
        except EtcdError as exc:  # expired meanwhile: the key is free anyway (or taken by another, seen next)
            logger.info("leader election: %s", exc)

    async def keep(self) -> None:
        """ACTIVE: refresh the lease; when etcd says it is gone, campaign again at once."""
        if await self.store.refresh(self._lease):
            return
        logger.warning("coordinator %s lost its leader lease (cut off from etcd longer than %ss)", self.name,
                       self.ttl_s)
        await self.campaign()

    async def step(self) -> None:
        """One round: keep the key while ACTIVE, try for it while STANDBY. etcd unreachable: keep the role."""
        try:
            if self.role is Role.ACTIVE:
                await self.keep()
            elif self.role is Role.STANDBY:
                await self.campaign()
        except EtcdUnavailable:
            pass  # the store logs the outage once; each coordinator keeps its role until etcd answers
        except EtcdError as exc:
            logger.warning("leader election: %s", exc)
        except Exception:  # the election must outlive any one bad round: a dead loop would never step down
            logger.exception("leader election round failed; keeping the role %s", self.role.value)

    def interval_s(self) -> float:
        return self.ttl_s / 3 if self.role is Role.ACTIVE else self.ttl_s / 6

    async def _run(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.interval_s())
            # Each step is a task of its own, shielded: cancelling this loop (resign) must not cancel a step
            # mid-call, whose etcd call would go on in the store's thread with its outcome unrecorded.
            self._step = asyncio.create_task(self.step())
            await asyncio.shield(self._step)

    async def start(self) -> None:
        """Campaign once now (so a coordinator that can lead serves from its first request), then keep at it."""
        if self.role is Role.REPLICA:
            return
        await self.step()
        self._task = asyncio.create_task(self._run())

    async def resign(self) -> None:
        """Stop campaigning and give the key up, so a standby takes over without waiting for the lease.

        A step under way is waited for (up to resign_wait_s), not cancelled: its create may be running on the
        store's thread, and would then leave the key on a lease never recorded here, held for a whole TTL. A
        step that outlasts the wait finds the coordinator stopping and gives back a key it wins."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        step, self._step = self._step, None
        if step is not None and not step.done():
            try:
                await asyncio.wait_for(asyncio.shield(step), self.resign_wait_s)
            except TimeoutError:
                logger.warning("leader election: a campaign still under way after %ss; giving up its lease",
                               self.resign_wait_s)
        if self.role is Role.ACTIVE:
            self._become(Role.STANDBY, "it is stopping")
        for lease in dict.fromkeys((self._lease, self._granted)):
            if not lease:
                continue
            try:
                await self.store.revoke(lease)
            except EtcdError as exc:
                logger.warning("could not give up the leader key (it expires within %ss): %s", self.ttl_s, exc)
        self._lease = self._granted = 0


def _name_of(value: bytes) -> str:
    return _field(value, "name") or value.decode("utf-8", "replace")


def _field(value: bytes, name: str) -> str:
    """A field of the leader key's value; "" when absent or not JSON."""
    try:
        return str(json.loads(value)[name])
    except (ValueError, KeyError, TypeError):
        return ""
