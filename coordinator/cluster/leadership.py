"""Leadership: which coordinator serves the clients, decided by one key in etcd (mode active_standby).

A coordinator's life in active_standby:
  1. It starts as STANDBY: its predict port answers 503 with Retry-After: 1 until it knows it leads.
  2. Campaign: when `{prefix}/leader` is free it grants a lease of lease_ttl_s and creates the key (its
     name) on that lease in one create-if-absent transaction. Whoever's create succeeds is ACTIVE; the
     others learn the holder from the same transaction and stay STANDBY.
  3. ACTIVE: it refreshes its lease every ttl/3. If etcd answers that the lease is gone (this coordinator
     was cut off from etcd for longer than the TTL), it campaigns again at once: it stays ACTIVE if the key
     is free, and steps down to STANDBY if another coordinator holds it.
  4. STANDBY: it campaigns every ttl/6, so it takes over within about ttl + ttl/6 of the active's death
     (whose lease then expires), and at once after the active steps down (whose lease is then revoked).
  5. etcd unreachable: each keeps its role. The active serves from what it knows; a standby waits.
  6. Stop (SIGTERM): an ACTIVE coordinator revokes its lease first, so a standby takes over while it drains.
In mode replicas nothing is campaigned for: every coordinator is a REPLICA and serves.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time

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
        self._lease = 0  # the lease the leader key is on while ACTIVE
        self._task: asyncio.Task | None = None

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
        if holder is None:
            lease = await self.store.grant(self.ttl_s)
            value = json.dumps({"name": self.name, "since": time.time()})
            holder = await self.store.create(self.key, value, lease)
            if holder is None:
                self._lease, self.leader = lease, self.name
                self._become(Role.ACTIVE, f"it holds {self.key}")
                return
            await self.store.revoke(lease)
        self._lease, self.leader = 0, _name_of(holder.value)
        self._become(Role.STANDBY, f"{self.leader} holds {self.key}")

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

    def interval_s(self) -> float:
        return self.ttl_s / 3 if self.role is Role.ACTIVE else self.ttl_s / 6

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s())
            await self.step()

    async def start(self) -> None:
        """Campaign once now (so a coordinator that can lead serves from its first request), then keep at it."""
        if self.role is Role.REPLICA:
            return
        await self.step()
        self._task = asyncio.create_task(self._run())

    async def resign(self) -> None:
        """Stop campaigning and give the key up, so a standby takes over without waiting for the lease."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.role is Role.ACTIVE:
            self._become(Role.STANDBY, "it is stopping")
            try:
                await self.store.revoke(self._lease)
            except EtcdError as exc:
                logger.warning("could not give up the leader key (it expires within %ss): %s", self.ttl_s, exc)
            self._lease = 0


def _name_of(value: bytes) -> str:
    try:
        return str(json.loads(value)["name"])
    except (ValueError, KeyError, TypeError):
        return value.decode("utf-8", "replace")
