"""CoordinatorPicker: the coordinator's routing behind a gateway's ext_proc, one pick per request.

A gateway request's life in the picker:
  1. Its tenant is admitted once (API key, or the trusted fairness header): 401 for a bad key, 429 past the tenant's
     concurrency or rpm (tpm counts prompt tokens here: the output streams past the picker). Held until it ends.
  2. Its prompt tokens are read from the body (routing_prompt.py), under the adapter its `model` names (after an
     x-llm-d-model-name-rewrite), and the router chooses decode and prefill workers as for the coordinator's own
     requests, among decode workers with a sidecar (sidecar_directory.py) inside the subset hint; 503 when none.
  3. The pick names the decode worker's sidecar, then fallbacks (least loaded first), and the prefill worker in
     x-prefiller-host-port (removed when the decode worker prefills). The decode worker is leased while it runs, the
     prefill worker (with the prompt tokens it must compute) until the response starts.
  4. The gateway reports the served endpoint as the response starts (with the first token): the prefill lease ends,
     and a fallback's decode worker takes the decode lease over.
  5. Its ext_proc stream closes: the lease and the tenant's hold end.
"""

from __future__ import annotations

import time

import orjson

from coordinator.errors import ApiError, WorkerError
from coordinator.gateway.endpoint_pick import (KV_PULL_HEADER, MODEL_REWRITE_HEADER, PREFILLER_HEADER, EndpointPick,
                                               GatewayRequest, PickRefused)
from coordinator.gateway.gie_metrics import GatewayMetrics
from coordinator.gateway.routing_prompt import RoutingPrompts
from coordinator.gateway.settings import GatewayConfig
from coordinator.gateway.sidecar_directory import SidecarDirectory
from coordinator.scheduling.policies import decode_load
from coordinator.scheduling.router import Placement
from coordinator.state import CoordinatorState
from coordinator.tenancy.admission import Admission
from coordinator.tenancy.tenants import TenantTicket
from coordinator.workers.instances import Instance, Lease
from kv_events.block_hash import lora_cache_tokens
from security.api_keys import ApiKeyStore, TenantTerms


class CoordinatorPick(EndpointPick):
    """A pick holding its decode worker's lease and its tenant's ticket until the request ends."""

    def __init__(self, picker: CoordinatorPicker, endpoints: list[str], placement: Placement, prompt_tokens: int,
                 ticket: TenantTicket | None, model: str, **changes):
        super().__init__(endpoints, **changes)
        self.picker = picker
        self.model = model
        self.ticket = ticket
        self.started = time.monotonic()
        self.lease: Lease | None = picker.registry.lease(placement.decode)
        self.lease.__enter__()
        # The prefill worker's load is what it must compute, until the response starts (with the first token).
        self.prefill_lease: Lease | None = None
        if placement.prefill is not None:
            self.prefill_lease = picker.registry.lease(placement.prefill, prompt_tokens=max(
                0, prompt_tokens - placement.prefill_covered_tokens))
            self.prefill_lease.__enter__()
        self.served_by = ""

    def _prefill_done(self) -> None:
        if self.prefill_lease is not None:
            self.prefill_lease.__exit__(None, None, None)
            self.prefill_lease = None

    def served(self, endpoint: str) -> None:
        self.served_by = endpoint
        self._prefill_done()
        self.picker.sidecars.heard_from(endpoint)
        decode = self.picker.decode_behind(endpoint)
        if decode is not None and self.lease is not None and decode is not self.lease.instance:
            self.lease.__exit__(None, None, None)  # a fallback served: its decode worker carries the load
            self.lease = self.picker.registry.lease(decode)
            self.lease.__enter__()

    def close(self) -> None:
        self._prefill_done()
        if self.lease is not None:
            self.lease.__exit__(None, None, None)
            self.lease = None
            self.picker.metrics.finished(self.model, time.monotonic() - self.started)
        if self.ticket is not None:
            self.ticket.close()
            self.ticket = None


class CoordinatorPicker:
    """Picks a sidecar (decode worker) and a prefill worker for each gateway request (life cycle above)."""

    def __init__(self, state: CoordinatorState, admission: Admission, keys: ApiKeyStore | None,
                 config: GatewayConfig):
        self.state = state
        self.registry = state.registry
        self.admission = admission
        self.keys = keys
        self.fallbacks = config.fallbacks
        self.sidecars = SidecarDirectory(config.sidecar_ttl_s, config.sidecar_port)
        self.prompts = RoutingPrompts(state.tokenizer)
        self.metrics = GatewayMetrics(config.pool_name, state.registry, self.sidecars)

    def decode_behind(self, endpoint: str) -> Instance | None:
        """The decode worker whose sidecar is at `endpoint`: by its announcement, else the one on its host (a
        sidecar found by gateway_config.sidecar_port)."""
        announced = self.sidecars.decode_of(endpoint)
        if announced is not None:
            return self.registry.get("decode", announced)
        return next((i for i in self.registry.pool("decode") if self.sidecars.endpoint_of(i.address) == endpoint),
                    None)

    async def pick(self, request: GatewayRequest) -> EndpointPick:
        headers = request.headers
        body, changed = _body(request.body, headers.get(MODEL_REWRITE_HEADER))
        model = str(body.get("model") or self.state.model_name) if isinstance(body, dict) else self.state.model_name
        ticket = None
        try:
            terms = self._key_terms(headers)  # first: a request without a valid key costs no tokenizing
            adapter = self.state.loras.select(model, "model") if self.state.loras is not None else None
            tokens, cut = await self.prompts.tokens(headers.get(":path", "/").split("?", 1)[0], body,
                                                    self._held if adapter is None else _nothing_held)
            ticket = self.admission.book.tenant(terms, self.admission.header_tenant(headers)).admit(len(tokens), 0)
            unreachable = self._unreachable(request.subset)
            # A prompt longer than its routed part is long: never one the decode worker should prefill alone.
            placement = self.state.router.route(
                lora_cache_tokens(tokens, adapter.digest) if adapter is not None else tokens,
                exclude_decode=unreachable, lora=adapter.name if adapter is not None else None,
                pullable=adapter is None, local_prefill=not cut)
        except BaseException as exc:
            if ticket is not None:
                ticket.close()
            if not isinstance(exc, ApiError):
                raise
            refusal = _refusal(exc, request.subset)
            self.metrics.refused(model, refusal.status)
            raise refusal from None
        decode = placement.decode
        endpoints = [self.sidecars.endpoint_of(decode.address)] + self._fallbacks(decode, unreachable)
        # A client's own headers must not choose a prefill worker or a pull: each is set or removed.
        set_headers = {}
        if placement.prefill is not None:
            set_headers[PREFILLER_HEADER] = placement.prefill.address
            if placement.pull_from:
                set_headers[KV_PULL_HEADER] = f"{placement.pull_from} {placement.pull_tokens}"
        remove = [h for h in (PREFILLER_HEADER, KV_PULL_HEADER) if h not in set_headers]
        self.metrics.picked(model)
        return CoordinatorPick(self, endpoints, placement, len(tokens), ticket, model, set_headers=set_headers,
                               remove_headers=remove, body=orjson.dumps(body) if changed else None)

    def _held(self, token_ids: list[int]) -> int:
        """The most leading tokens of `token_ids` a worker's cache holds, by the KV index (0 without one)."""
        match = self.state.router.policy.match(token_ids)
        return max([*match.prefill.values(), *match.decode.values()], default=0)

    def _key_terms(self, headers: dict[str, str]) -> TenantTerms | None:
        """The tenant terms of the request's API key (None without a keys file); 401 for a missing or wrong key."""
        if self.keys is None:
            return None
        why, terms = self.keys.identify(headers.get("authorization"))
        if why is not None:
            raise ApiError(401, f"API key {why}: send Authorization: Bearer <key>",
                           headers={"WWW-Authenticate": 'Bearer realm="pdserve"'})
        return terms

    def _unreachable(self, subset: list[str] | None) -> set[str]:
        """Decode workers the gateway cannot be sent to: without a sidecar, or outside the subset hint."""
        allowed = set(subset) if subset is not None else None
        return {i.address for i in self.registry.pool("decode")
                if (endpoint := self.sidecars.endpoint_of(i.address)) is None
                or (allowed is not None and endpoint not in allowed)}

    def _fallbacks(self, chosen: Instance, unreachable: set[str]) -> list[str]:
        if not self.fallbacks:
            return []
        others = sorted((i for i in self.registry.pool("decode")
                         if i is not chosen and i.available and not i.held and i.address not in unreachable),
                        key=decode_load)
        return [self.sidecars.endpoint_of(i.address) for i in others[: self.fallbacks]]


def _nothing_held(token_ids: list[int]) -> int:
    return 0  # under an adapter the cache holds salted ids: its window is not widened


def _body(raw: bytes, rewrite: str | None) -> tuple[object, bool]:
    """The JSON body (None when it is not JSON), with its `model` rewritten when the header asks."""
    if not raw:
        return None, False
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None, False
    if rewrite and isinstance(body, dict) and body.get("model") != rewrite:
        body["model"] = rewrite
        return body, True
    return body, False


def _refusal(exc: ApiError | WorkerError, subset: list[str] | None) -> PickRefused:
    if isinstance(exc, WorkerError):
        where = f" in the subset hint {subset}" if subset is not None else ""
        return PickRefused(503, f"no decode worker with a sidecar is ready{where}: {exc.message}",
                           {"Retry-After": "1"}, error_type="service_unavailable")
    return PickRefused(exc.status, exc.message, dict(exc.headers or {}), error_type=exc.error_type)
