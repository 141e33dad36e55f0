"""ReplicaCensus: how many coordinators serve beside this one (backup_config.mode replicas), so each takes
its share of every tenant's limits.

  1. Join: this coordinator puts `{prefix}/replicas/{name}` on a lease of lease_ttl_s; its value is the
     replica's release and wire formats (proto/wire_versions.py), read by the others' ClusterFormats.
  2. Every sync round: it refreshes the lease (a lost lease is granted and the key put again), counts the keys
     under `{prefix}/replicas/` and tells `on_count` the number, itself included.
  3. Leave (SIGTERM): it revokes the lease, so the others count one fewer at their next round.
A replica that dies unannounced is counted until its lease expires (lease_ttl_s): meanwhile the others hold
their smaller shares. etcd unreachable: the last count stands.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from coordinator.cluster.etcd_store import EtcdError, EtcdStore
from proto.wire_versions import PREVIOUS, THIS_PROCESS, FormatRange, WireVersions

logger = logging.getLogger(__name__)


class ReplicaCensus:
    """This replica's leased presence in etcd, and the count of all present."""

    def __init__(self, store: EtcdStore, prefix: str, name: str, ttl_s: int):
        self.store = store
        self.prefix = f"{prefix}/replicas/"
        self.key = f"{self.prefix}{name}"
        self.ttl_s = ttl_s
        self.count = 1
        self.versions: dict[str, WireVersions] = {}  # the other replicas' releases and formats, by name
        self.on_count: Callable[[int], None] | None = None
        self._lease = 0

    async def round(self) -> None:
        """Keep this replica's key alive and count the replicas; etcd unreachable: keep the last count."""
        try:
            if not self._lease or not await self.store.refresh(self._lease):
                self._lease = 0
                lease = await self.store.grant(self.ttl_s)
                # Its release and formats (a replica of release 0.1.0 wrote "1" and only counts the keys).
                await self.store.put(self.key, json.dumps(THIS_PROCESS.describe()), lease)
                self._lease = lease  # only once its key is written: a failed put is tried again next round
            entries = await self.store.get_prefix(self.prefix)
        except EtcdError:
            return
        self.versions = {e.key[len(self.prefix):]: replica_versions(e.value) for e in entries if e.key != self.key}
        count = max(1, len(entries))
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


def replica_versions(value: bytes) -> WireVersions:
    """What a replica's census record says of its release and formats; "1" (release 0.1.0): the previous one."""
    try:
        record = json.loads(value)
        return WireVersions(str(record["release"]),
                            {name: FormatRange(int(r[0]), int(r[1])) for name, r in record["formats"].items()})
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return PREVIOUS
