"""ClusterNode: this coordinator as one of several sharing a cluster through etcd (backup_config).

  1. Start (before the ports serve): read the registry from etcd (so the workers registered through the
     others are routable at once, and probed), then campaign for the leader key once (active_standby).
  2. Every sync_interval_s: re-read the registry, publish this coordinator's health verdicts and adopt the
     others'. The leadership keeps its own timer (ttl/3 while active, ttl/6 while standby).
  3. In mode replicas, every round also counts the replicas (`replica_census.py`): each takes its share of
     the tenants' limits.
  4. The management port reports registrations, heartbeats and deregistrations as they happen; they reach
     etcd in the background.
  5. Every round also reads the replicas' wire versions and the cluster's finalize (`wire_formats.py`).
  6. SIGTERM: step down first (a standby takes over while this one drains), then stop.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

from coordinator.periodic_rounds import PeriodicRounds
from coordinator.cluster.etcd_store import EtcdError, EtcdStore
from coordinator.cluster.leadership import Leadership, Role
from coordinator.cluster.registry_sync import RegistrySync
from coordinator.cluster.replica_census import ReplicaCensus
from coordinator.cluster.shared_health import SharedHealth
from coordinator.cluster.wire_formats import ClusterFormats
from coordinator.config import CoordinatorConfig
from coordinator.workers.health_monitor import HealthMonitor
from coordinator.workers.instances import Instance, InstanceRegistry

logger = logging.getLogger(__name__)


def coordinator_name(config: CoordinatorConfig) -> str:
    """backup_config.coordinator_name, else predict_ip:predict_port (with the process id when the port is 0,
    picked at start, so two such coordinators on one host still differ)."""
    http = config.http_config
    name = config.backup_config.coordinator_name
    if name:
        return name
    return f"{http.predict_ip}:{http.predict_port}" if http.predict_port else f"{http.predict_ip}:0/{os.getpid()}"


class ClusterNode:
    """The etcd store, the leadership, the registry sync and the shared health of one coordinator."""

    def __init__(self, store: EtcdStore, leadership: Leadership, sync: RegistrySync, health: SharedHealth,
                 monitor: HealthMonitor, interval_s: float, census: ReplicaCensus | None = None):
        self.store = store
        self.census = census  # mode replicas: the count of replicas, for the tenants' shares
        self.leadership = leadership
        self.sync = sync
        self.health = health
        self.monitor = monitor
        self.rounds = PeriodicRounds(self._round, interval_s, "etcd sync round")
        self.formats: ClusterFormats | None = None  # learns the replicas' versions and the finalize each round
        self.finalized_key = ""  # {key_prefix}/finalized: the release the operator finalized (from_config)

    @classmethod
    def from_config(cls, config: CoordinatorConfig, registry: InstanceRegistry, monitor: HealthMonitor,
                    on_forget: Callable[[Instance], Awaitable[None]] | None = None) -> ClusterNode:
        backup = config.backup_config
        name = coordinator_name(config)
        store = EtcdStore(backup.etcd_endpoints, backup.etcd_timeout_s, config.tls_config.etcd)
        leadership = Leadership(store, f"{backup.key_prefix}/leader", name, backup.lease_ttl_s,
                                replicas=backup.mode == "replicas")
        sync = RegistrySync(store, registry, backup.key_prefix, config.health_config.heartbeat_timeout_s, on_forget)
        health = SharedHealth(store, registry, backup.key_prefix, name, sync.lease_of)
        census = (ReplicaCensus(store, backup.key_prefix, name, backup.lease_ttl_s)
                  if backup.mode == "replicas" else None)
        node = cls(store, leadership, sync, health, monitor, backup.sync_interval_s, census)
        node.finalized_key = f"{backup.key_prefix}/finalized"
        return node

    @property
    def name(self) -> str:
        return self.leadership.name

    @property
    def role(self) -> Role:
        return self.leadership.role

    @property
    def serving(self) -> bool:
        return self.leadership.serving

    def describe(self) -> dict:
        """What /health adds: this coordinator's role and etcd's reachability."""
        described = {"role": self.role.value, "coordinator": self.name, "leader": self.leadership.leader,
                     "etcd": self.store.status()}
        if self.census is not None:
            described["replicas"] = self.census.count  # each takes 1/replicas of every tenant's limits
        return described

    # The management port's news, passed on to etcd in the background.
    def registered(self, instance: Instance) -> None:
        self.sync.registered(instance)

    def heartbeat(self, instance: Instance) -> None:
        self.sync.heartbeat(instance)

    def deregistered(self, role: str, address: str) -> None:
        self.sync.deregistered(role, address)

    def heartbeating(self, role: str, address: str) -> bool:
        """Whether a registered worker's heartbeats are current on this coordinator's evidence (etcd down: not
        the mere presence of its key at the last read), for the 409 of a second registration of its address."""
        return self.sync.heartbeating(role, address)

    async def _round(self) -> None:
        learned = await self.sync.sync_once()
        if learned:
            await asyncio.gather(*(self.monitor.check(i) for i in learned))
        await self.health.exchange()
        if self.census is not None:
            await self.census.round()
        if self.formats is not None:
            await self._read_formats()

    async def _read_formats(self) -> None:
        if self.census is not None:
            self.formats.set_replicas(dict(self.census.versions))
        if not self.finalized_key:
            return
        try:
            entry = await self.store.get(self.finalized_key)
        except EtcdError:
            return  # the last finalize read stands
        if entry is not None:
            self.formats.adopt_finalized(entry.value.decode(errors="replace"))

    async def finalize(self) -> str:
        """Finalize this release for the cluster (ClusterFormats.finalize) and store it in etcd for the others."""
        release = self.formats.finalize()
        await self.store.put(self.finalized_key, release)
        return release

    async def start(self) -> None:
        await self.sync.start()
        try:
            await self._round()
        except Exception:  # start all the same: the next round reads the registry again
            logger.exception("first etcd sync round failed")
        await self.leadership.start()
        logger.info("coordinator %s joined the cluster on etcd %s as %s", self.name, self.store.endpoints,
                       self.role.value)
        self.rounds.start()

    async def step_down(self) -> None:
        """Give up the leader key (a standby takes over) and serve no new client requests."""
        await self.leadership.resign()

    async def stop(self) -> None:
        await self.rounds.stop()
        await self.leadership.resign()
        if self.census is not None:
            await self.census.leave()
        await self.sync.stop()
        self.store.close()
