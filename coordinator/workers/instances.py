"""The instance registry: every prefill and decode worker the coordinator knows, and its health.

Instances come from `instances` in ms_coordinator.json and from registration on the management
port. Each is in one state:
  - HEALTHY: routable.
  - UNHEALTHY: its circuit is open: `failure_threshold` consecutive failed requests or health
    checks, a failure that shows it is gone (connection refused or reset), or a registered worker
    that missed its heartbeats. A passing health check (and, for a registered worker, a heartbeat)
    puts it back.
  - DRAINING: it said it is shutting down, or an operator drains it (`held`, until resumed); it finishes its
    requests and gets no new ones.

Each role's RolePool keeps its routable instances ready for routing (in address order, and in each
policy's load order), updated as instances change, so a request costs the same with 2 or 256 instances.
"""

from __future__ import annotations

import bisect
import enum
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from operator import attrgetter
from typing import Protocol

from proto.wire_versions import PREVIOUS, WireVersions

ROLES = ("prefill", "decode", "encode")
KV_ROLES = ("prefill", "decode")  # the roles whose caches hold KV blocks (an encode worker's holds images)


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
    loras: frozenset[str] = frozenset()  # LoRA adapters loaded on it now (loading another costs time)
    tier_blocks: int = 0  # blocks its KV tier holds
    tier_hit_tokens: int = 0  # prompt tokens it loaded from its tier instead of computing, since start
    pulls: int = 0  # prompts' leading blocks it pulled from peers, since start
    pulled_bytes: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0


def _watched(name: str) -> property:
    """An attribute routing reads: each change is told to the instance's pool, which keeps its orders current."""
    slot = "_" + name

    def changed(self: Instance, value) -> None:
        setattr(self, slot, value)
        if self._pool is not None:
            self._pool.changed(self)

    return property(attrgetter(slot), changed)


class Instance:
    """One worker, its state, and the work this coordinator has on it right now."""

    __slots__ = ("role", "address", "registered", "metrics_url", "reason", "consecutive_failures", "last_heartbeat",
                 "num_heartbeats", "num_served", "successes", "credential", "last_heard", "step_ms", "versions", "held", "_state",
                 "_reported", "_outstanding_requests", "_outstanding_prompt_tokens", "_pool")

    # What routing reads; the pool hears of every change, so no request has to rescan the instances.
    state = _watched("state")
    reported = _watched("reported")  # what the worker said in its last health check
    outstanding_requests = _watched("outstanding_requests")  # requests this coordinator has on it
    outstanding_prompt_tokens = _watched("outstanding_prompt_tokens")  # prefill: sent and not yet prefilled

    def __init__(self, role: str, address: str):
        self._pool: RolePool | None = None  # set while the registry holds it
        self.role = role
        self.address = address
        self.registered = False  # came by registration (heartbeats expected), not from the config file
        self.metrics_url = ""
        self.reason = ""  # why it is not healthy
        self.consecutive_failures = 0
        self.last_heartbeat = 0.0
        self.num_heartbeats = 0  # heartbeats accepted: shows they arrive (GET /v1/instances has no clock to read)
        self.num_served = 0
        self.successes = 0  # requests that ended well on it: the health monitor takes them as proof of life
        self.credential = ""  # SHA-256 of the credential issued at registration; its heartbeats must carry that
        # For the silence watch: when the worker last showed it is alive (a token, an answer, a new request
        # on an idle instance), and its recent decode step time in ms (0 until a token says).
        self.last_heard = 0.0
        self.step_ms = 0.0
        # Its release and wire formats, from its health answers; until one says, the previous release (which
        # announced none): its formats are what a pairing may use with it.
        self.versions: WireVersions = PREVIOUS
        self.held = False  # drained by POST /v1/instances/drain: out of routing until resumed, whatever it answers
        self._state = InstanceState.HEALTHY
        self._reported = ReportedLoad()
        self._outstanding_requests = 0
        self._outstanding_prompt_tokens = 0

    @property
    def available(self) -> bool:
        return self._state is InstanceState.HEALTHY

    def __repr__(self) -> str:
        return f"Instance({self.role}, {self.address}, {self._state.value})"

    def describe(self) -> dict:
        return {
            "role": self.role, "address": self.address, "state": self.state.value, "reason": self.reason,
            "source": "registered" if self.registered else "config", "metrics_url": self.metrics_url,
            "consecutive_failures": self.consecutive_failures, "heartbeats": self.num_heartbeats,
            "outstanding_requests": self.outstanding_requests,
            "outstanding_prompt_tokens": self.outstanding_prompt_tokens, "served": self.num_served,
            **self.versions.describe(), "held": self.held,
            "reported": {"num_running": self.reported.num_running, "num_waiting": self.reported.num_waiting,
                         "kv_used_tokens": self.reported.kv_used_tokens,
                         "kv_capacity_tokens": self.reported.kv_capacity_tokens,
                         "queued_prompt_tokens": self.reported.queued_prompt_tokens,
                         "lora_adapters": sorted(self.reported.loras),
                         "kv_tier_blocks": self.reported.tier_blocks,
                         "tier_hit_tokens": self.reported.tier_hit_tokens,
                         "kv_pulls": self.reported.pulls, "kv_pulled_bytes": self.reported.pulled_bytes},
        }


class PoolWatcher(Protocol):
    """An index over a pool's routable instances (a policy's load order), kept current by the pool."""

    def admit(self, instance: Instance) -> None: ...
    def evict(self, instance: Instance) -> None: ...
    def update(self, instance: Instance) -> None: ...


class RolePool:
    """One role's instances. The routable ones are kept in address order, and the watchers (policies' load
    orders) hear of each change, so routing a request reads these instead of scanning every instance."""

    def __init__(self, role: str):
        self.role = role
        self._by_address: dict[str, Instance] = {}
        self._routable: set[str] = set()
        self.routable: list[str] = []  # addresses of the routable instances, sorted
        self._watchers: list[PoolWatcher] = []
        # Routable instances whose load moved since the watchers last looked: a lease changes an instance
        # several times per request, and the orders need its figures only when a request is routed.
        self._dirty: set[Instance] = set()

    def __iter__(self) -> Iterator[Instance]:
        return iter(self._by_address.values())

    def __len__(self) -> int:
        return len(self._by_address)

    def get(self, address: str) -> Instance | None:
        return self._by_address.get(address)

    def is_routable(self, address: str) -> bool:
        return address in self._routable

    def add(self, instance: Instance) -> None:
        self._by_address[instance.address] = instance
        instance._pool = self
        self.changed(instance)

    def remove(self, address: str) -> Instance | None:
        instance = self._by_address.pop(address, None)
        if instance is not None:
            instance._pool = None  # leases still running on it no longer move the orders
            self._set_routable(instance, False)
        return instance

    def watch(self, watcher: PoolWatcher) -> None:
        """Keep `watcher` current from now on, starting with every routable instance."""
        self.settle()
        self._watchers.append(watcher)
        for address in self.routable:
            watcher.admit(self._by_address[address])

    def settle(self) -> None:
        """Bring the watchers up to date; call before reading them."""
        if self._dirty:
            for instance in self._dirty:
                for watcher in self._watchers:
                    watcher.update(instance)
            self._dirty.clear()

    def changed(self, instance: Instance) -> None:
        routable = instance._state is InstanceState.HEALTHY
        if routable != (instance.address in self._routable):
            self._set_routable(instance, routable)
        elif routable and self._watchers:
            self._dirty.add(instance)

    def _set_routable(self, instance: Instance, routable: bool) -> None:
        address = instance.address
        if routable:
            self._routable.add(address)
            bisect.insort(self.routable, address)
            for watcher in self._watchers:
                watcher.admit(instance)
        elif address in self._routable:
            self._routable.discard(address)
            self._dirty.discard(instance)
            del self.routable[bisect.bisect_left(self.routable, address)]
            for watcher in self._watchers:
                watcher.evict(instance)


class Lease:
    """One request (and its prompt tokens to prefill) counted on an instance while a `with` block runs.

    A block that ends normally is a success for the circuit breaker; failures are recorded by whoever
    classifies them (`record_failure`), since the instance at fault need not be the leased one.
    """

    __slots__ = ("registry", "instance", "prompt_tokens")

    def __init__(self, registry: InstanceRegistry, instance: Instance, prompt_tokens: int):
        self.registry = registry
        self.instance = instance
        self.prompt_tokens = prompt_tokens

    def __enter__(self) -> Instance:
        instance = self.instance
        if not instance._outstanding_requests:  # silence on an idle instance is no news: count from now
            instance.last_heard = time.monotonic()
        instance.outstanding_requests += 1
        if self.prompt_tokens:
            instance.outstanding_prompt_tokens += self.prompt_tokens
        instance.num_served += 1
        return instance

    def __exit__(self, exc_type, exc, tb) -> None:
        instance = self.instance
        instance.outstanding_requests -= 1
        if self.prompt_tokens:
            instance.outstanding_prompt_tokens -= self.prompt_tokens
        if exc_type is None:
            self.registry.record_success(instance)


class InstanceRegistry:
    """Instances by role and address, with the circuit breaker's bookkeeping."""

    def __init__(self, prefill: list[str] = (), decode: list[str] = (), failure_threshold: int = 3,
                 heartbeat_timeout_s: float = 10.0, forget_after_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic):
        self.failure_threshold = failure_threshold
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.forget_after_s = forget_after_s
        self.clock = clock
        self.version = 0  # counts instances coming and going, so watchers resync only when it moves
        self.versions_seen = 0  # counts instances coming and going and changes of their announced wire versions
        self._pools: dict[str, RolePool] = {role: RolePool(role) for role in ROLES}
        for role, addresses in (("prefill", prefill), ("decode", decode)):
            for address in addresses:
                self._add(Instance(role, address))

    def pool(self, role: str) -> RolePool:
        return self._pools[role]

    def instances(self, role: str) -> list[Instance]:
        return list(self._pools[role])

    def available(self, role: str, exclude: frozenset[str] | set[str] = frozenset()) -> list[Instance]:
        return [i for i in self._pools[role] if i.available and i.address not in exclude]

    def get(self, role: str, address: str) -> Instance | None:
        return self._pools[role].get(address)

    def register(self, role: str, address: str, metrics_url: str = "") -> Instance:
        """Add a worker (or welcome one back): it is routable at once."""
        instance = self._pools[role].get(address)
        if instance is None:
            instance = self._add(Instance(role, address))
        instance.registered = True
        instance.metrics_url = metrics_url
        instance.last_heartbeat = self.clock()
        self._close(instance)
        return instance

    def add_static(self, role: str, address: str) -> Instance:
        """Add an instance as the config lists one: health-checked, never expected to heartbeat."""
        return self._pools[role].get(address) or self._add(Instance(role, address))

    def heartbeat(self, role: str, address: str) -> bool:
        """False when the instance is unknown (it must register again)."""
        instance = self._pools[role].get(address)
        if instance is None or not instance.registered:
            return False
        instance.last_heartbeat = self.clock()
        instance.num_heartbeats += 1
        if instance.state is InstanceState.UNHEALTHY and instance.reason == "missed heartbeats":
            self._close(instance)
        return True

    def deregister(self, role: str, address: str) -> bool:
        """Forget a worker; requests already on it run to their end."""
        return self._remove(role, address) is not None

    def lease(self, instance: Instance, prompt_tokens: int = 0) -> Lease:
        """Count one request (and `prompt_tokens` to prefill) on `instance` while a `with` block runs."""
        return Lease(self, instance, prompt_tokens)

    def record_success(self, instance: Instance) -> None:
        instance.consecutive_failures = 0
        instance.successes += 1

    def record_failure(self, instance: Instance, reason: str, gone: bool = False) -> None:
        """Count a failed request or check; `gone` (the worker cannot be reached) opens the circuit at once."""
        instance.consecutive_failures += 1
        if gone or instance.consecutive_failures >= self.failure_threshold:
            if instance.state is InstanceState.HEALTHY:
                instance.state = InstanceState.UNHEALTHY
            instance.reason = reason

    def record_health(self, instance: Instance, load: ReportedLoad | None, draining: bool,
                      versions: WireVersions | None = None) -> None:
        """A health check answered: the circuit closes unless the worker drains or missed heartbeats; `load`
        None: the load was not read, the last one read stands (so do `versions`, when None)."""
        if load is not None:
            instance.reported = load
        if versions is not None and versions != instance.versions:
            instance.versions = versions
            self.versions_seen += 1
        if draining or instance.held:
            instance.reason = "draining" if draining else "drained by the operator (POST /v1/instances/drain)"
            instance.state = InstanceState.DRAINING
        elif not (instance.registered and self._heartbeat_late(instance)):
            self._close(instance)

    def expire_heartbeats(self) -> list[Instance]:
        """Take out registered workers that went silent, and forget long-silent ones; returns the forgotten."""
        forgotten = []
        now = self.clock()
        for role in ROLES:
            for instance in list(self._pools[role]):
                if not instance.registered:
                    continue
                silent = now - instance.last_heartbeat
                if silent > self.forget_after_s:
                    self._remove(role, instance.address)
                    forgotten.append(instance)
                elif silent > self.heartbeat_timeout_s and instance.state is InstanceState.HEALTHY:
                    instance.reason, instance.state = "missed heartbeats", InstanceState.UNHEALTHY
        return forgotten

    def _add(self, instance: Instance) -> Instance:
        self._pools[instance.role].add(instance)
        self.version += 1
        self.versions_seen += 1
        return instance

    def _remove(self, role: str, address: str) -> Instance | None:
        instance = self._pools[role].remove(address)
        if instance is not None:
            self.version += 1
            self.versions_seen += 1
        return instance

    def _heartbeat_late(self, instance: Instance) -> bool:
        return self.clock() - instance.last_heartbeat > self.heartbeat_timeout_s

    @staticmethod
    def _close(instance: Instance) -> None:
        instance.consecutive_failures = 0
        if not instance.held:  # an operator's drain outlasts any proof of life
            instance.reason, instance.state = "", InstanceState.HEALTHY

    def hold(self, instance: Instance) -> None:
        """Take it out of routing until `release` (an operator's drain)."""
        instance.held = True
        instance.reason, instance.state = "drained by the operator (POST /v1/instances/drain)", InstanceState.DRAINING

    def release(self, instance: Instance) -> None:
        """Back into routing at its next passing health check."""
        instance.held = False

    def snapshot(self) -> dict:
        """Every instance by role; `encode` only where there are encode workers (as a release without them)."""
        return {role: [i.describe() for i in self._pools[role]] for role in ROLES
                if role in KV_ROLES or len(self._pools[role])}
