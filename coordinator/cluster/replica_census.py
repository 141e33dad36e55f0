"""ReplicaCensus: how many coordinators serve beside this one (backup_config.mode replicas), so each takes
its share of every tenant's limits.

  1. Join: this coordinator puts `{prefix}/replicas/{name}` on a lease of lease_ttl_s.
  2. Every sync round: it refreshes the lease (a lost lease is granted and the key put again), counts the keys
     under `{prefix}/replicas/` and tells `on_count` the number, itself included.
  3. Leave (SIGTERM): it revokes the lease, so the others count one fewer at their next round.
A replica that dies unannounced is counted until its lease expires (lease_ttl_s): meanwhile the others hold
their smaller shares. etcd unreachable: the last count stands.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from coordinator.cluster.etcd_store import EtcdError, EtcdStore

logger = logging.getLogger(__name__)


class ReplicaCensus:
    """This replica's leased presence in etcd, and the count of all present."""

    def __init__(self, store: EtcdStore, prefix: str, name: str, ttl_s: int):
        self.store = store
        self.prefix = f"{prefix}/replicas/"
        self.key = f"{self.prefix}{name}"
        self.ttl_s = ttl_s
        self.count = 1
        self.on_count: Callable[[int], None] | None = None
        self._lease = 0

    async def round(self) -> None:
        """Keep this replica's key alive and count the replicas; etcd unreachable: keep the last count."""
        try:
            if not self._lease or not await self.store.refresh(self._lease):
                self._lease = 0
                lease = await self.store.grant(self.ttl_s)
                await self.store.put(self.key, "1", lease)
                self._lease = lease  # only once its key is written: a failed put is tried again next round
            count = max(1, len(await self.store.get_prefix(self.prefix)))
        except EtcdError:
            return
        if count != self.count:
            logger.info("%d coordinator replicas: each takes 1/%d of every tenant's limits", count, count)
            self.count = count
            if self.on_count is not None:
                self.on_count(count)

    async def leave(self) -> None:
        if self._lease:
            try:
                await self.store.revoke(self._lease)
            except EtcdError:
                pass  # the lease expires on its own
            self._lease = 0
