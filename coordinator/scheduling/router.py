"""Picks the prefill and decode instance of each request from the registry's healthy ones."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.errors import WorkerError
from coordinator.instances import Instance, InstanceRegistry
from coordinator.scheduling.policies import RoundRobinPolicy


@dataclass(frozen=True)
class Placement:
    """The workers that serve one request; no prefill instance means the decode worker prefills."""

    prefill: Instance | None
    decode: Instance

    def instance(self, role: str) -> Instance | None:
        return self.prefill if role == "prefill" else self.decode


class Router:
    """Applies the configured policy to the instances that are routable right now (the registry keeps them
    ready per role, so a request costs the same whatever the number of instances)."""

    def __init__(self, registry: InstanceRegistry, policy: RoundRobinPolicy, local_prefill_max_tokens: int = 0):
        self.registry = registry
        self.policy = policy
        self.local_prefill_max_tokens = local_prefill_max_tokens

    def choose_decode(self, exclude: set[str] = frozenset()) -> Instance:
        choice = self.policy.choose_decode(self.registry.pool("decode"), exclude)
        if choice is None:
            raise WorkerError(_none_left("decode", self.registry, exclude))
        return choice

    def choose_prefill(self, prompt_token_ids: list[int], exclude: set[str] = frozenset()) -> Instance | None:
        """A prefill instance, or None when none is left outside `exclude`."""
        choice = self.policy.choose_prefill(self.registry.pool("prefill"), prompt_token_ids, exclude)
        if choice is not None:
            self.policy.on_prefill_routed(choice, prompt_token_ids)
        return choice

    def route(self, prompt_token_ids: list[int], exclude_decode: set[str] = frozenset(),
              exclude_prefill: set[str] = frozenset()) -> Placement:
        decode = self.choose_decode(exclude_decode)
        if len(prompt_token_ids) < self.local_prefill_max_tokens:
            return Placement(None, decode)
        prefill = self.choose_prefill(prompt_token_ids, exclude_prefill)
        if prefill is None:
            raise WorkerError(_none_left("prefill", self.registry, exclude_prefill))
        return Placement(prefill, decode)


def _none_left(role: str, registry: InstanceRegistry, exclude: set[str]) -> str:
    known = registry.instances(role)
    if not known:
        return f"no {role} instance is configured or registered"
    states = ", ".join(f"{i.address}: {'tried' if i.address in exclude else i.state.value}"
                       + (f" ({i.reason})" if i.reason and i.address not in exclude else "") for i in known)
    return f"no healthy {role} instance left ({states})"
