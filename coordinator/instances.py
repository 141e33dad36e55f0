"""The instance registry: every prefill and decode worker the coordinator knows, and its health.

Instances come from `instances` in ms_coordinator.json and from registration on the management
port. Each is in one state:
  - HEALTHY: routable.
  - UNHEALTHY: its circuit is open: `failure_threshold` consecutive failed requests or health
    checks, a failure that shows it is gone (connection refused or reset), or a registered worker
    that missed its heartbeats. A passing health check (and, for a registered worker, a heartbeat)
    puts it back.
  - DRAINING: it said it is shutting down; it finishes its requests and gets no new ones.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

ROLES = ("prefill", "decode")


class InstanceState(enum.Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"


@dataclass(frozen=True)
class ReportedLoad:
    """What the worker said in its last health check."""

    num_running: int = 0
    num_waiting: int = 0
    kv_used_tokens: int = 0
    kv_capacity_tokens: int = 0
    queued_prompt_tokens: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0


@dataclass(eq=False)
class Instance:
    """One worker, its state, and the work this coordinator has on it right now."""

    role: str
    address: str
    registered: bool = False  # came by registration (heartbeats expected), not from the config file
    metrics_url: str = ""
    state: InstanceState = InstanceState.HEALTHY
    reason: str = ""  # why it is not healthy
    consecutive_failures: int = 0
    last_heartbeat: float = 0.0
    reported: ReportedLoad = field(default_factory=ReportedLoad)
    outstanding_requests: int = 0  # requests this coordinator has on it
    outstanding_prompt_tokens: int = 0  # prefill: prompt tokens sent and not yet prefilled
    num_served: int = 0
    credential: str = field(default="", repr=False)  # issued at registration; its heartbeats must carry it

    @property
    def available(self) -> bool:
        return self.state is InstanceState.HEALTHY

    def describe(self) -> dict:
        return {
            "role": self.role, "address": self.address, "state": self.state.value, "reason": self.reason,
            "source": "registered" if self.registered else "config", "metrics_url": self.metrics_url,
            "consecutive_failures": self.consecutive_failures,
            "outstanding_requests": self.outstanding_requests,
            "outstanding_prompt_tokens": self.outstanding_prompt_tokens, "served": self.num_served,
            "reported": {"num_running": self.reported.num_running, "num_waiting": self.reported.num_waiting,
                         "kv_used_tokens": self.reported.kv_used_tokens,
                         "kv_capacity_tokens": self.reported.kv_capacity_tokens,
                         "queued_prompt_tokens": self.reported.queued_prompt_tokens},
        }


class InstanceRegistry:
    """Instances by role and address, with the circuit breaker's bookkeeping."""

    def __init__(self, prefill: list[str] = (), decode: list[str] = (), failure_threshold: int = 3,
                 heartbeat_timeout_s: float = 10.0, forget_after_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic):
        self.failure_threshold = failure_threshold
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.forget_after_s = forget_after_s
        self.clock = clock
        self._by_role: dict[str, dict[str, Instance]] = {role: {} for role in ROLES}
        for role, addresses in (("prefill", prefill), ("decode", decode)):
            for address in addresses:
                self._by_role[role][address] = Instance(role, address)

    def instances(self, role: str) -> list[Instance]:
        return list(self._by_role[role].values())

    def available(self, role: str, exclude: frozenset[str] | set[str] = frozenset()) -> list[Instance]:
        return [i for i in self._by_role[role].values() if i.available and i.address not in exclude]

    def get(self, role: str, address: str) -> Instance | None:
        return self._by_role[role].get(address)

    def register(self, role: str, address: str, metrics_url: str = "") -> Instance:
        """Add a worker (or welcome one back): it is routable at once."""
        instance = self._by_role[role].get(address)
        if instance is None:
            instance = self._by_role[role][address] = Instance(role, address)
        instance.registered = True
        instance.metrics_url = metrics_url
        instance.last_heartbeat = self.clock()
        self._close(instance)
        return instance

    def heartbeat(self, role: str, address: str) -> bool:
        """False when the instance is unknown (it must register again)."""
        instance = self._by_role[role].get(address)
        if instance is None or not instance.registered:
            return False
        instance.last_heartbeat = self.clock()
        if instance.state is InstanceState.UNHEALTHY and instance.reason == "missed heartbeats":
            self._close(instance)
        return True

    def deregister(self, role: str, address: str) -> bool:
        """Forget a worker; requests already on it run to their end."""
        return self._by_role[role].pop(address, None) is not None

    @contextlib.contextmanager
    def lease(self, instance: Instance, prompt_tokens: int = 0) -> Iterator[Instance]:
        """Count one request (and `prompt_tokens` to prefill) on `instance` while the block runs.

        A block that ends normally is a success for the circuit breaker; failures are recorded by whoever
        classifies them (`record_failure`), since the instance at fault need not be the leased one.
        """
        instance.outstanding_requests += 1
        instance.outstanding_prompt_tokens += prompt_tokens
        instance.num_served += 1
        try:
            yield instance
        finally:
            instance.outstanding_requests -= 1
            instance.outstanding_prompt_tokens -= prompt_tokens
        self.record_success(instance)

    def record_success(self, instance: Instance) -> None:
        instance.consecutive_failures = 0

    def record_failure(self, instance: Instance, reason: str, gone: bool = False) -> None:
        """Count a failed request or check; `gone` (the worker cannot be reached) opens the circuit at once."""
        instance.consecutive_failures += 1
        if gone or instance.consecutive_failures >= self.failure_threshold:
            if instance.state is InstanceState.HEALTHY:
                instance.state = InstanceState.UNHEALTHY
            instance.reason = reason

    def record_health(self, instance: Instance, load: ReportedLoad, draining: bool) -> None:
        """A health check answered: the circuit closes unless the worker drains or missed heartbeats."""
        instance.reported = load
        if draining:
            instance.state, instance.reason = InstanceState.DRAINING, "draining"
        elif not (instance.registered and self._heartbeat_late(instance)):
            self._close(instance)

    def expire_heartbeats(self) -> list[Instance]:
        """Take out registered workers that went silent, and forget long-silent ones; returns the forgotten."""
        forgotten = []
        for role in ROLES:
            for instance in list(self._by_role[role].values()):
                if not instance.registered:
                    continue
                silent = self.clock() - instance.last_heartbeat
                if silent > self.forget_after_s:
                    del self._by_role[role][instance.address]
                    forgotten.append(instance)
                elif silent > self.heartbeat_timeout_s and instance.state is InstanceState.HEALTHY:
                    instance.state, instance.reason = InstanceState.UNHEALTHY, "missed heartbeats"
        return forgotten

    def _heartbeat_late(self, instance: Instance) -> bool:
        return self.clock() - instance.last_heartbeat > self.heartbeat_timeout_s

    @staticmethod
    def _close(instance: Instance) -> None:
        instance.state, instance.reason, instance.consecutive_failures = InstanceState.HEALTHY, "", 0

    def snapshot(self) -> dict:
        return {role: [i.describe() for i in self._by_role[role].values()] for role in ROLES}
