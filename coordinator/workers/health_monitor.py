"""Health checks: every instance's Health RPC on a timer, feeding the registry's circuit breaker
and the load figures the load_balance and cache_affinity policies route by.

An instance that is busy and answering (requests on it ended well since its last probe, and more
are running) is probed only every `busy_interval_s`: those requests already prove it alive, so a
probe would bring nothing but fresher load figures. A busy fleet thus costs N / busy_interval_s
probes a second rather than N / interval_s. The probes of a round still go out together: spread
over the interval, the same probes cost gRPC's poller more CPU (measured: +30-60% at 64 instances).
"""

from __future__ import annotations

import asyncio
import logging
import time

from coordinator.periodic_rounds import PeriodicRounds
from coordinator.requests.failures import WorkerCallError
from coordinator.workers.instances import Instance, InstanceRegistry, InstanceState
from coordinator.workers.client import WorkerClient

logger = logging.getLogger(__name__)

# A busy, answering instance is probed this many times less often.
BUSY_INTERVAL_FACTOR = 4


class HealthMonitor:
    """Probes the instances every `interval_s` (a busy, answering one every `busy_interval_s`); forgets
    registered workers that went silent."""

    def __init__(self, registry: InstanceRegistry, client: WorkerClient, interval_s: float, timeout_s: float,
                 on_forget=None, busy_interval_s: float | None = None):
        self.registry = registry
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_forget = on_forget
        self.busy_interval_s = interval_s * BUSY_INTERVAL_FACTOR if busy_interval_s is None else busy_interval_s
        self.clock = time.monotonic
        self._probed: dict[Instance, tuple[float, int]] = {}  # when each was last probed, and its successes then
        self.rounds = PeriodicRounds(self.check_due, interval_s, "health check round")

    async def check(self, instance: Instance) -> None:
        self._probed[instance] = (self.clock(), instance.successes)
        try:
            report = await self.client.health(instance.address, instance.role, timeout=self.timeout_s)
        except Exception as exc:  # any failure to answer counts against the instance
            why = exc.failure.code if isinstance(exc, WorkerCallError) else type(exc).__name__
            was = instance.state
            self.registry.record_failure(instance, f"health check failed: {why}")
            if was is InstanceState.HEALTHY and instance.state is not InstanceState.HEALTHY:
                logger.warning("%s instance %s taken out: %s", instance.role, instance.address, instance.reason)
            return
        was = instance.state
        self.registry.record_health(instance, report.load, draining=report.draining, versions=report.versions)
        if was is not instance.state:
            logger.warning("%s instance %s is now %s", instance.role, instance.address, instance.state.value)

    async def check_all(self) -> None:
        """Probe every instance now (after forgetting the long-silent ones)."""
        await self._round(everyone=True)

    async def check_due(self) -> None:
        """One timer round: every instance but the busy, answering ones probed recently enough."""
        await self._round(everyone=False)

    async def _round(self, everyone: bool) -> None:
        for instance in self.registry.expire_heartbeats():
            logger.warning("%s instance %s forgotten: no heartbeat", instance.role, instance.address)
            if self.on_forget is not None:
                await self.on_forget(instance)
        instances = self.registry.instances("prefill") + self.registry.instances("decode")
        if len(self._probed) > len(instances):  # some left: drop what is known of them
            present = set(instances)
            self._probed = {i: probed for i, probed in self._probed.items() if i in present}
        now = self.clock()
        await asyncio.gather(*(self.check(i) for i in instances if everyone or not self._answering(i, now)))

    def _answering(self, instance: Instance, now: float) -> bool:
        """Requests on it ended well since its last probe, more are running, and that probe is recent enough."""
        probed = self._probed.get(instance)
        return (probed is not None and instance.available and instance.outstanding_requests > 0
                and instance.consecutive_failures == 0 and instance.successes != probed[1]
                and now - probed[0] < self.busy_interval_s)

    def start(self) -> None:
        self.rounds.start()

    async def stop(self) -> None:
        await self.rounds.stop()
