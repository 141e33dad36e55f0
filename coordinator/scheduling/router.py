"""Picks the prefill and decode instance of each request from the registry's healthy ones."""

from __future__ import annotations

from dataclasses import dataclass, replace

from coordinator.errors import WorkerError
from coordinator.requests.request import NamedPrefill
from coordinator.workers.instances import Instance, InstanceRegistry
from coordinator.scheduling.policies import RoundRobinPolicy


@dataclass(frozen=True)
class Placement:
    """The workers that serve one request; no prefill instance means the decode worker prefills. The cached
    counts are what the index expected each to hold of the prompt when it was chosen."""

    prefill: Instance | None
    decode: Instance
    prefill_cached_tokens: int = 0
    decode_cached_tokens: int = 0
    pull_from: str = ""  # the instance the prefill worker pulls the prompt's leading blocks from ("": none)
    pull_tokens: int = 0

    @property
    def prefill_covered_tokens(self) -> int:
        """Leading prompt positions the prefill worker need not compute: held there, or pulled."""
        return max(self.prefill_cached_tokens, self.pull_tokens)

    def instance(self, role: str) -> Instance | None:
        return self.prefill if role == "prefill" else self.decode


class Router:
    """Applies the configured policy to the instances that are routable right now (the registry keeps them
    ready per role, so a request costs the same whatever the number of instances)."""

    def __init__(self, registry: InstanceRegistry, policy: RoundRobinPolicy, local_prefill_max_tokens: int = 0):
        self.registry = registry
        self.policy = policy
        self.local_prefill_max_tokens = local_prefill_max_tokens
        # The KV layout ranges the prefill instances announced, as of registry.versions_seen: one range (every
        # release of the cluster writes the same layout) spares each request a scan of the prefill pool.
        self._prefill_layouts: tuple[int, frozenset] = (-1, frozenset())

    def route(self, prompt_token_ids: list[int], exclude_decode: set[str] = frozenset(),
              exclude_prefill: set[str] = frozenset(), lora: str | None = None, local_prefill: bool = True,
              pullable: bool = True, prefill_at: NamedPrefill | None = None) -> Placement:
        """The decode instance first; then, unless the part of the prompt it does not hold is shorter than
        local_prefill_max_tokens (it prefills that itself; never without `local_prefill`), a prefill instance
        (`lora`: the request's adapter; `pullable`: whether a prefill worker may pull its leading blocks from a
        peer: not under an adapter or with images). `prefill_at`: a sidecar's request, the prefill the gateway's
        picker placed."""
        policy, registry = self.policy, self.registry
        match = policy.match(prompt_token_ids)
        prompt_len = len(prompt_token_ids)
        decode = policy.choose_decode(registry.pool("decode"), prompt_len, match.decode, exclude_decode, lora,
                                      match=match)
        if decode is None:
            raise WorkerError(_none_left("decode", registry, exclude_decode))
        decode_cached = match.decode.get(decode.address, 0)
        if prefill_at is not None:
            return self._named_prefill(prefill_at, decode, decode_cached, exclude_prefill, local_prefill)
        # Blocks only expected there are not there yet: prefilling locally would compute them all.
        if local_prefill and prompt_len - decode_cached + match.expected.get(decode.address, 0) \
                < self.local_prefill_max_tokens:
            policy.expect(None, decode, prompt_token_ids)
            return Placement(None, decode, decode_cached_tokens=decode_cached)
        if not pullable:
            match = replace(match, pullable=False)
        exclude_prefill = exclude_prefill | self._unpairable(decode)
        prefill = policy.choose_prefill(registry.pool("prefill"), prompt_len, match.prefill, exclude_prefill, lora,
                                        match=match)
        if prefill is None:
            raise WorkerError(_none_left("prefill", registry, exclude_prefill))
        policy.expect(prefill, decode, prompt_token_ids)
        prefill_cached = match.prefill.get(prefill.address, 0)
        pull_from, pull_tokens = policy.pull_source(match, prefill.address, prefill_cached,
                                                    exclude_prefill | exclude_decode)
        return Placement(prefill, decode, prefill_cached, decode_cached, pull_from, pull_tokens)

    def _named_prefill(self, named: NamedPrefill, decode: Instance, decode_cached: int, exclude: set[str],
                       local_prefill: bool) -> Placement:
        """A sidecar's placement: the prefill worker the gateway named, added on first sight, pulling where the picker
        said; the decode worker prefills itself when none was named, or the named one failed or is down (a sidecar
        has no other)."""
        address, prefill = named.address, None
        if address and address not in exclude:
            prefill = self.registry.get("prefill", address) or self.registry.add_static("prefill", address)
            if not prefill.available:
                prefill = None
        if prefill is None and not local_prefill:
            raise WorkerError(f"this request needs a prefill worker (prompt logprobs) and the gateway named "
                              f"{'no usable one' if address else 'none'} (header x-prefiller-host-port)")
        if prefill is None:
            return Placement(None, decode, decode_cached_tokens=decode_cached)
        return Placement(prefill, decode, decode_cached_tokens=decode_cached, pull_from=named.pull_from,
                         pull_tokens=named.pull_tokens)

    def _unpairable(self, decode: Instance) -> set[str] | frozenset[str]:
        """The prefill instances that write no KV layout `decode` reads (a mixed-release cluster pairs only on one
        both ends have; within one release every pair has one, and this is empty)."""
        seen = self.registry.versions_seen
        if self._prefill_layouts[0] != seen:
            self._prefill_layouts = (seen, _layouts(self.registry.pool("prefill")))
        layout = decode.versions.range("kv_layout")
        if all(r.common_newest(layout) is not None for r in self._prefill_layouts[1]):
            return frozenset()
        return {p.address for p in self.registry.pool("prefill")
                if p.versions.range("kv_layout").common_newest(layout) is None}


def _layouts(prefills) -> frozenset:
    return frozenset(p.versions.range("kv_layout") for p in prefills)


def _none_left(role: str, registry: InstanceRegistry, exclude: set[str]) -> str:
    known = registry.instances(role)
    if not known:
        return f"no {role} instance is configured or registered"
    states = ", ".join(f"{i.address}: {'tried' if i.address in exclude else i.state.value}"
                       + (f" ({i.reason})" if i.reason and i.address not in exclude else "") for i in known)
    return f"no healthy {role} instance left ({states})"
