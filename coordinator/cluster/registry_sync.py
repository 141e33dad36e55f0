"""RegistrySync: the registered workers, shared by every coordinator of a cluster through etcd.

A worker's life in etcd:
  1. It registers through any coordinator's management port. That coordinator puts
     `{prefix}/instances/{role}/{address}` (role, address, metrics_url, the SHA-256 of the credential it
     issued, never the credential itself) on a lease of health_config.heartbeat_timeout_s of its own.
  2. Each heartbeat, through whichever coordinator, refreshes that lease: the coordinator reads the key to
     learn the lease, and puts the record again on a fresh lease if it has gone.
  3. Every sync_interval_s each coordinator reads the prefix and applies it to its InstanceRegistry: a new
     key registers the worker there (so it is routed to, and its heartbeats are accepted by their digest);
     a present key counts as a heartbeat (the lease proves them); a key gone since the last read (the worker
     deregistered, or its lease expired because its heartbeats stopped) deregisters and forgets it.
  4. Deregistration through any coordinator deletes the key.
etcd unreachable: nothing is dropped. Each coordinator serves from the last registry it read, the workers
it last read count as alive (health checks still take out the dead ones), and registration and heartbeats
go on locally. Alive for routing is not proof of heartbeats, though: `heartbeating()` (the management
port's test before it refuses a second registration of an address) then counts only what was true at the
last read and the heartbeats heard here, so a worker restarted on its address can register again once
heartbeat_timeout_s has passed without either, as it could without etcd. When etcd answers again each coordinator puts the workers that registered or heartbeat
through it on fresh leases, replays the deletions that failed, and reads the prefix again: a worker that
registered through one coordinator during the outage then appears on the others.

Writes never hold up a management call: the calls queue them (one pending operation per worker, a newer one
replacing an older one) and one task writes them in order. Workers from the `instances` config section stay
local: they are never written.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field

from coordinator.cluster.etcd_store import Entry, EtcdError, EtcdStore, EtcdUnavailable
from coordinator.workers.instances import ROLES, Instance, InstanceRegistry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerRecord:
    """A registered worker as etcd holds it."""

    role: str
    address: str
    metrics_url: str
    credential_sha256: str
    registered_at: float  # wall-clock time of its registration: the newer of two registrations wins

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, value: bytes) -> WorkerRecord:
        data = json.loads(value)
        if data.get("role") not in ROLES:
            raise ValueError(f"unknown role {data.get('role')!r}")
        return cls(str(data["role"]), str(data["address"]), str(data.get("metrics_url", "")),
                   str(data["credential_sha256"]), float(data.get("registered_at", 0)))

    @classmethod
    def of(cls, instance: Instance, registered_at: float) -> WorkerRecord:
        return cls(instance.role, instance.address, instance.metrics_url, instance.credential, registered_at)


@dataclass(frozen=True)
class LocalView:
    """What this coordinator's registry says of a registered worker, for the diff."""

    credential_sha256: str
    registered_at: float


@dataclass
class SyncPlan:
    """What one read of the prefix changes in the local registry."""

    learned: list[WorkerRecord] = field(default_factory=list)  # unknown here: register them
    updated: list[WorkerRecord] = field(default_factory=list)  # registered again elsewhere since: new credential
    vanished: list[tuple[str, str]] = field(default_factory=list)  # (role, address) read last time, gone now


def plan_sync(previous: Mapping[str, WorkerRecord], listed: Mapping[str, WorkerRecord],
              local: Callable[[str, str], LocalView | None]) -> SyncPlan:
    """Diff one read (`listed`, by key) against the last one and the local registry (`local(role, address)`:
    its view of a registered worker, None when it has none)."""
    plan = SyncPlan()
    for record in listed.values():
        view = local(record.role, record.address)
        if view is None:
            plan.learned.append(record)
        elif view.credential_sha256 != record.credential_sha256 and record.registered_at > view.registered_at:
            plan.updated.append(record)
    plan.vanished = [(r.role, r.address) for key, r in previous.items() if key not in listed]
    return plan


class RegistrySync:
    """Keeps the local registry's registered workers and the etcd prefix in step (life cycle above)."""

    def __init__(self, store: EtcdStore, registry: InstanceRegistry, prefix: str, lease_ttl_s: float,
                 on_forget: Callable[[Instance], Awaitable[None]] | None = None, clock=time.monotonic):
        self.store = store
        self.registry = registry
        self.prefix = f"{prefix}/instances/"
        self.lease_ttl_s = lease_ttl_s
        self.on_forget = on_forget
        self.clock = clock
        self._listed: dict[str, WorkerRecord] = {}  # the last read, by key
        self._leases: dict[str, int] = {}  # the lease of each key in the last read
        self._registered_at: dict[str, float] = {}  # wall-clock registration time of each registered worker
        self._heard: dict[str, float] = {}  # when each worker last registered or heartbeat through this one
        self._pending: dict[str, tuple[str, WorkerRecord | None]] = {}  # key -> ("put"|"refresh"|"delete", record)
        self._failed_deletes: set[str] = set()  # deregistrations etcd did not hear of: replayed on resync
        self._wake = asyncio.Event()
        self._writer: asyncio.Task | None = None
        self._reconnects_seen = 0
        self._read_at = float("-inf")  # when the last read of the prefix succeeded

    def key(self, role: str, address: str) -> str:
        return f"{self.prefix}{role}/{address}"

    def lease_of(self, role: str, address: str) -> int:
        """The lease of a worker's key as last read; 0 when unknown."""
        return self._leases.get(self.key(role, address), 0)

    def heartbeating(self, role: str, address: str) -> bool:
        """Whether a registered worker's heartbeats are current, on this coordinator's evidence: what the
        management port asks before it refuses (409) a registration of the address by another worker.

        etcd reachable: the registry's own view (its lease was alive at the last read, or it heartbeat here).
        etcd unreachable: the registry still counts the workers of the last read as alive, so as not to drop
        them; but that is no proof of heartbeats, so only the last read and the heartbeats heard here count,
        and heartbeat_timeout_s after both the address is free again, as it is without etcd."""
        instance = self.registry.get(role, address)
        if instance is None or not instance.registered:
            return False
        timeout = self.registry.heartbeat_timeout_s
        if self.store.reachable:
            return self.registry.clock() - instance.last_heartbeat < timeout
        key = self.key(role, address)
        proof = max(self._heard.get(key, float("-inf")), self._read_at if key in self._listed else float("-inf"))
        return self.clock() - proof < timeout

    # --- What the management port tells it: queued, never awaited on etcd ---

    def registered(self, instance: Instance) -> None:
        key = self.key(instance.role, instance.address)
        self._heard[key] = self.clock()
        self._registered_at[key] = time.time()
        self._failed_deletes.discard(key)
        self._queue(key, "put", WorkerRecord.of(instance, self._registered_at[key]))

    def heartbeat(self, instance: Instance) -> None:
        key = self.key(instance.role, instance.address)
        self._heard[key] = self.clock()
        if self._pending.get(key, ("",))[0] != "put":  # a put gives a fresh lease anyway
            self._queue(key, "refresh", self._record(instance))

    def deregistered(self, role: str, address: str) -> None:
        key = self.key(role, address)
        self._heard.pop(key, None)
        self._registered_at.pop(key, None)
        self._queue(key, "delete", None)

    def _record(self, instance: Instance) -> WorkerRecord:
        key = self.key(instance.role, instance.address)
        return WorkerRecord.of(instance, self._registered_at.setdefault(key, time.time()))

    def _queue(self, key: str, op: str, record: WorkerRecord | None) -> None:
        self._pending.pop(key, None)  # re-queued at the end: operations run in the order they were last asked
        self._pending[key] = (op, record)
        self._wake.set()

    # --- Writing ---

    async def _write(self, key: str, op: str, record: WorkerRecord | None) -> None:
        if op == "delete":
            self._failed_deletes.discard(key)
            await self.store.delete(key)
        elif op == "put":
            await self._put(key, record)
        else:
            entry = await self.store.get(key)
            if entry is None or not await self.store.refresh(entry.lease):
                await self._put(key, record)  # expired (or never landed): this heartbeat proves it alive

    async def _put(self, key: str, record: WorkerRecord) -> None:
        lease = await self.store.grant(self.lease_ttl_s)
        await self.store.put(key, record.to_json(), lease)

    async def flush(self) -> None:
        """Write the pending operations, oldest first. etcd unreachable: only deletions are tried (and kept
        for the resync when they fail); the resync puts every registered worker anyway."""
        while self._pending:
            key = next(iter(self._pending))
            op, record = self._pending.pop(key)
            if not self.store.reachable and op != "delete":
                continue
            try:
                await self._write(key, op, record)
            except EtcdUnavailable:
                if op == "delete":
                    self._failed_deletes.add(key)
            except EtcdError as exc:
                logger.warning("etcd %s of %s failed: %s", op, key, exc)
            except Exception:  # one bad write must not cost the others
                logger.exception("etcd %s of %s failed", op, key)

    async def _run_writer(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.flush()
            except Exception:  # the writer must outlive any one bad round: else nothing is written again
                logger.exception("etcd writes failed")

    async def resync(self) -> None:
        """etcd is back: replay the failed deletions, and put on a fresh lease every registered worker that
        registered or heartbeat through this coordinator within the lease TTL. Those are the ones it can vouch
        for: a worker known only from etcd is put back by its own coordinator, and one that left or died during
        the outage is not brought back."""
        for key in list(self._failed_deletes):
            self._queue(key, "delete", None)
        now, num_put = self.clock(), 0
        for role in ROLES:
            for instance in self.registry.instances(role):
                key = self.key(role, instance.address)
                if instance.registered and now - self._heard.get(key, float("-inf")) < self.lease_ttl_s:
                    self._queue(key, "put", self._record(instance))
                    num_put += 1
        logger.warning("etcd resync: %d workers heard here put again, %d deletions replayed", num_put,
                       len(self._failed_deletes))

    # --- Reading ---

    def _local(self, role: str, address: str) -> LocalView | None:
        instance = self.registry.get(role, address)
        if instance is None or not instance.registered:
            return None
        return LocalView(instance.credential, self._registered_at.get(self.key(role, address), 0.0))

    def _parse(self, entries: list[Entry]) -> dict[str, WorkerRecord]:
        listed = {}
        for entry in entries:
            try:
                record = WorkerRecord.from_json(entry.value)
            except (ValueError, KeyError, TypeError) as exc:
                logger.debug("skipping malformed etcd record %s: %s", entry.key, exc)
                continue
            if entry.key == self.key(record.role, record.address):
                listed[entry.key] = record
                self._leases[entry.key] = entry.lease
        return listed

    async def sync_once(self) -> list[Instance]:
        """Read the prefix and apply it; returns the workers learned from it (for a first health check).
        etcd unreachable: the workers of the last read count as heartbeating, and nothing changes."""
        try:
            entries = await self.store.get_prefix(self.prefix)
        except EtcdError:
            # Alive for routing (see heartbeating(): not for the 409 of a second registration).
            for record in self._listed.values():
                self.registry.heartbeat(record.role, record.address)
            return []
        self._read_at = self.clock()
        previous = self._listed
        if self.store.num_reconnects != self._reconnects_seen:
            self._reconnects_seen = self.store.num_reconnects
            await self.resync()
            # This read may come before the other coordinators' resyncs (an etcd that lost its data lists
            # nothing): take what it adds, and judge what is missing at the next read.
            previous = {}
        self._leases = {}
        listed = self._parse(entries)
        plan = plan_sync(previous, listed, self._local)
        learned = []
        for record in plan.learned:
            instance = self.registry.register(record.role, record.address, record.metrics_url)
            self._adopt(instance, record)
            learned.append(instance)
            logger.info("%s instance %s learned from etcd", record.role, record.address)
        for record in plan.updated:
            instance = self.registry.get(record.role, record.address)
            instance.metrics_url = record.metrics_url
            self._adopt(instance, record)
        for record in listed.values():  # its lease is alive: it heartbeats through some coordinator
            self.registry.heartbeat(record.role, record.address)
        for role, address in plan.vanished:
            await self._vanished(role, address)
        self._listed = listed if previous is self._listed else {**self._listed, **listed}
        return learned

    def _adopt(self, instance: Instance, record: WorkerRecord) -> None:
        instance.credential = record.credential_sha256
        self._registered_at[self.key(record.role, record.address)] = record.registered_at

    async def _vanished(self, role: str, address: str) -> None:
        key = self.key(role, address)
        instance = self.registry.get(role, address)
        if instance is None or not instance.registered:
            return
        if self.clock() - self._heard.get(key, float("-inf")) < self.lease_ttl_s:
            # It heartbeats through this coordinator: its lease lapsed some other way (a refresh lost to an
            # etcd hiccup). Put it back rather than drop a live worker.
            self._queue(key, "put", self._record(instance))
            return
        self.registry.deregister(role, address)
        self._registered_at.pop(key, None)
        self._heard.pop(key, None)
        logger.warning("%s instance %s left the cluster: its etcd key is gone (deregistered, or its heartbeats "
                       "stopped)", role, address)
        if self.on_forget is not None:
            await self.on_forget(instance)

    async def start(self) -> None:
        self._writer = asyncio.create_task(self._run_writer())

    async def stop(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)
