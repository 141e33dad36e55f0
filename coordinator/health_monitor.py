"""Health checks: every instance's Health RPC on a timer, feeding the registry's circuit breaker
and the load figures the load_balance and cache_affinity policies route by."""

from __future__ import annotations

import asyncio
import logging

from coordinator.failures import WorkerCallError
from coordinator.instances import Instance, InstanceRegistry, InstanceState
from coordinator.worker_client import WorkerClient

logger = logging.getLogger(__name__)


class HealthMonitor:
    """Probes all instances every `interval_s`; forgets registered workers that went silent."""

    def __init__(self, registry: InstanceRegistry, client: WorkerClient, interval_s: float, timeout_s: float,
                 on_forget=None):
        self.registry = registry
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_forget = on_forget
        self._task: asyncio.Task | None = None

    async def check(self, instance: Instance) -> None:
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
        self.registry.record_health(instance, report.load, draining=report.draining)
        if was is not instance.state:
            logger.warning("%s instance %s is now %s", instance.role, instance.address, instance.state.value)

    async def check_all(self) -> None:
        for instance in self.registry.expire_heartbeats():
            logger.warning("%s instance %s forgotten: no heartbeat", instance.role, instance.address)
            if self.on_forget is not None:
                await self.on_forget(instance)
        instances = self.registry.instances("prefill") + self.registry.instances("decode")
        await asyncio.gather(*(self.check(i) for i in instances))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_all()
            except Exception:  # the monitor must outlive any one bad round
                logger.exception("health check round failed")

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
