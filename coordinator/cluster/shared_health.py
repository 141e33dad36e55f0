"""SharedHealth: one coordinator's verdict on a worker, heard by the others.

  1. Publish: when this coordinator's view of a registered worker's state changes (healthy, unhealthy,
     draining), it puts `{prefix}/health/{role}/{address}` = {state, reason, by, at} on the worker's own
     lease, so the verdict goes when the worker does. A change made before the worker's lease is known here
     (just registered, not yet read back from etcd) waits for it.
  2. Adopt: a verdict "unhealthy" from another coordinator, written since the last read, takes the worker
     out here at once (reason "reported unhealthy by <name>: <reason>"); this coordinator's own health
     checks bring it back when it answers. Other states are not adopted: each coordinator routes to a
     worker only on its own evidence that it works.
Verdicts present when this coordinator starts are history: the first read only notes them.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from coordinator.cluster.etcd_store import EtcdError, EtcdStore
from coordinator.workers.instances import ROLES, InstanceRegistry, InstanceState

logger = logging.getLogger(__name__)

ADOPTED = "reported unhealthy by "


class SharedHealth:
    """Publishes this coordinator's state changes of registered workers and adopts the others' unhealthy ones."""

    def __init__(self, store: EtcdStore, registry: InstanceRegistry, prefix: str, name: str,
                 lease_of: Callable[[str, str], int]):
        self.store = store
        self.registry = registry
        self.prefix = f"{prefix}/health/"
        self.name = name
        self.lease_of = lease_of  # a worker's lease, from the registry sync's last read; 0 when unknown
        self._published: dict[str, InstanceState] = {}  # the state this coordinator last stood for, by key
        self._seen: dict[str, int] = {}  # mod revision of each verdict already read
        self._baseline = True

    def key(self, role: str, address: str) -> str:
        return f"{self.prefix}{role}/{address}"

    async def publish(self) -> None:
        """Put a verdict for each registered worker whose state changed here since the last one."""
        for role in ROLES:
            for instance in self.registry.instances(role):
                if not instance.registered:
                    continue
                key = self.key(role, instance.address)
                state = instance.state
                if self._published.get(key, InstanceState.HEALTHY) is state:
                    continue
                if instance.reason.startswith(ADOPTED):
                    self._published[key] = state  # another's verdict: nothing to tell
                    continue
                lease = self.lease_of(role, instance.address)
                if not lease:
                    continue  # not read back from etcd yet: still a change next round, published then
                verdict = {"state": state.value, "reason": instance.reason, "by": self.name, "at": time.time()}
                await self.store.put(key, json.dumps(verdict), lease)
                self._published[key] = state

    async def adopt(self) -> None:
        """Read the verdicts; take out a worker another coordinator found unhealthy since the last read."""
        entries = await self.store.get_prefix(self.prefix)
        baseline, self._baseline = self._baseline, False
        seen, self._seen = self._seen, {entry.key: entry.mod_revision for entry in entries}
        for entry in entries:
            if seen.get(entry.key) == entry.mod_revision:
                continue
            try:
                verdict = json.loads(entry.value)
                role, address = entry.key[len(self.prefix):].split("/", 1)
                by, state, reason = str(verdict["by"]), str(verdict["state"]), str(verdict.get("reason", ""))
            except (ValueError, KeyError, TypeError):
                continue
            if baseline or by == self.name or state != InstanceState.UNHEALTHY.value:
                continue
            instance = self.registry.get(role, address) if role in ROLES else None
            if instance is not None and instance.state is InstanceState.HEALTHY:
                instance.reason = f"{ADOPTED}{by}: {reason}"
                instance.state = InstanceState.UNHEALTHY
                self._published[entry.key] = InstanceState.UNHEALTHY
                logger.warning("%s instance %s taken out: %s", role, address, instance.reason)

    async def exchange(self) -> None:
        """One round: publish, then adopt. etcd unreachable: try again next round."""
        try:
            await self.publish()
            await self.adopt()
        except EtcdError:
            pass  # the store logs the outage; unpublished changes are still different next round
        except Exception:  # the exchange must outlive any one bad round
            logger.exception("health verdict exchange failed")
