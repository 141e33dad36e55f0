"""The silence watch: a worker that goes quiet without closing its connections (a frozen process, a hung
host, a cut link) is found within seconds instead of at the request's deadline.

  1. Every TICK_S, each instance with requests in flight whose last sign of life (`Instance.last_heard`:
     a token, a prefill's answer, a new request on an idle instance) is older than its silence bound
     gets a health probe. The bound follows the worker's own cadence: SILENCE_STEPS decode steps,
     between MIN_SILENCE_S and `silence_timeout_s`; a prefill worker, with no steps to count, gets
     `silence_timeout_s`.
  2. An answered probe is a sign of life: a worker busy with long prefills, or a decode worker whose
     requests wait for their KV caches, is silent and well.
  3. A probe unanswered within `probe_timeout_s` (its deadline passed, or no connection), with no token
     from the worker meanwhile, declares the worker lost: its circuit opens (it is out
     of rotation until a health check passes) and every call in flight to it fails as UNAVAILABLE, as a
     connection reset would, so its streams migrate and its prefills are retried elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from coordinator.periodic_rounds import PeriodicRounds
from coordinator.requests.failures import WorkerCallError
from coordinator.workers.instances import ROLES, Instance, InstanceRegistry
from coordinator.workers.client import WorkerClient

logger = logging.getLogger(__name__)

TICK_S = 0.25
# What a probe of a worker that cannot answer ends with: its deadline, or no connection.
SILENT_CODES = frozenset({"DEADLINE_EXCEEDED", "UNAVAILABLE"})
SILENCE_STEPS = 50
MIN_SILENCE_S = 0.5


class SilenceWatch:
    """Probes the workers that went silent with requests in flight; declares the unanswering ones lost."""

    def __init__(self, registry: InstanceRegistry, client: WorkerClient, silence_timeout_s: float,
                 probe_timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.registry = registry
        self.client = client
        self.silence_timeout_s = silence_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.clock = clock
        self._probing: dict[Instance, asyncio.Task] = {}
        self.rounds = PeriodicRounds(self.tick, TICK_S, "silence watch tick")

    def bound(self, instance: Instance) -> float:
        """Seconds of silence after which `instance` is probed."""
        if instance.step_ms <= 0:
            return self.silence_timeout_s
        return min(self.silence_timeout_s, max(MIN_SILENCE_S, SILENCE_STEPS * instance.step_ms / 1000))

    def silent(self) -> list[Instance]:
        """Instances with requests in flight, silent past their bound, and not being probed already."""
        now = self.clock()
        return [instance for role in ROLES for instance in self.registry.pool(role)
                if instance.outstanding_requests and instance not in self._probing
                and now - instance.last_heard > self.bound(instance)]

    def tick(self) -> None:
        """Start a probe of every silent instance."""
        for instance in self.silent():
            task = self._probing[instance] = asyncio.create_task(self.probe(instance))
            task.add_done_callback(lambda _, i=instance: self._probing.pop(i, None))

    async def probe(self, instance: Instance) -> None:
        heard = instance.last_heard
        silent_for = self.clock() - heard
        try:
            await self.client.probe(instance.address, instance.role, timeout=self.probe_timeout_s)
        except WorkerCallError as exc:
            # Any other status the worker sent back (say UNAUTHENTICATED after a secret reload) is an answer; and
            # a token that came meanwhile is a sign of life.
            answered = exc.failure.code not in SILENT_CODES
            if not answered and instance.last_heard == heard:
                await self.declare_lost(instance, f"silent for {silent_for:.1f}s with requests in flight, and no "
                                                  f"answer to a health check within {self.probe_timeout_s}s "
                                                  f"({exc.failure.code})")
                return
        except Exception:  # noqa: BLE001 - not a worker's answer, nor proof of its loss
            logger.exception("probe of %s instance %s failed", instance.role, instance.address)
            return
        instance.last_heard = max(instance.last_heard, self.clock())

    async def declare_lost(self, instance: Instance, why: str) -> None:
        """Take `instance` out and fail every call in flight to it as UNAVAILABLE."""
        reason = f"worker lost: {why}"
        logger.warning("%s instance %s %s", instance.role, instance.address, reason)
        self.registry.record_failure(instance, reason, gone=True)
        await self.client.lose(instance.address, reason)

    def start(self) -> None:
        self.rounds.start()

    async def stop(self) -> None:
        await self.rounds.stop()
        probes = list(self._probing.values())
        for task in probes:
            task.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
