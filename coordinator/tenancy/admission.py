"""Who a client request is for and how urgent it is: its tenant (API key, or a trusted gateway's fairness
header), the tenant's limits, and its priority from the headers every API may send.

Priority headers, on every API (MindIE's and Triton's `priority` field wins where the body gives one):
  - `x-pdserve-priority: 1..5` (1 first, 5 last, the levels MindIE and Triton use);
  - `x-llm-d-inference-objective: NAME` (Gateway API Inference Extension; older gateways send
    `x-gateway-inference-objective`), mapped to a level by tenancy_config.objectives; `x-pdserve-priority` wins
    when both are sent.
And `x-pdserve-speculative: on|off`: off turns the decode worker's speculative drafting off for the request (no
draft hints either); on, the default, leaves it to the worker.
"""

from __future__ import annotations

import dataclasses
import re
import time

from aiohttp import web

from coordinator.errors import ApiError
from coordinator.gateway.endpoint_pick import (FAIRNESS_HEADER, OBJECTIVE_HEADER, OLD_FAIRNESS_HEADER,
                                               OLD_OBJECTIVE_HEADER)
from coordinator.requests.limits import ModelLimits
from coordinator.requests.request import DEFAULT_PRIORITY, GenerationRequest
from coordinator.tenancy.settings import TenancyConfig
from coordinator.tenancy.tenants import Tenant, TenantTicket
from security.api_keys import RESERVED_NAMES, ApiKeyStore, TenantTerms

PRIORITY_HEADER = "x-pdserve-priority"
SPECULATIVE_HEADER = "x-pdserve-speculative"
KEY_TERMS = web.RequestKey("key_tenant", TenantTerms)  # the API key's tenant, set by the key gate
ANONYMOUS, OVERFLOW = RESERVED_NAMES  # requests without a key or a trusted header; header names past max_tenants
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}\Z")


class TenantBook:
    """Every tenant seen, by name, each made on first use from the keys file's terms or the defaults."""

    def __init__(self, config: TenancyConfig, keys: ApiKeyStore | None = None, clock=time.monotonic):
        self.config = config
        self.keys = keys
        self.clock = clock
        self.replicas = 1
        self.tenants: dict[str, Tenant] = {}
        self._header_named = 0

    def default_terms(self, name: str) -> TenantTerms:
        c = self.config
        return TenantTerms(name, c.default_weight, c.default_rpm, c.default_tpm, c.default_concurrency)

    def tenant(self, terms: TenantTerms | None, header_name: str | None = None) -> Tenant:
        """The tenant of a request whose key has `terms` (None: no key) and whose trusted fairness header says
        `header_name` (None: not sent, or not trusted)."""
        if header_name is not None:
            named = self.keys.tenants().get(header_name) if self.keys is not None else None
            if named is not None:
                return self._with_terms(named)
            tenant = self.tenants.get(header_name)
            if tenant is not None:
                return tenant
            if self._header_named >= self.config.max_tenants:
                return self.tenants.get(OVERFLOW) or self._with_terms(self.default_terms(OVERFLOW))
            self._header_named += 1
            return self._with_terms(self.default_terms(header_name))
        if terms is None:
            return self.tenants.get(ANONYMOUS) or self._with_terms(self.default_terms(ANONYMOUS))
        return self._with_terms(terms)

    def _with_terms(self, terms: TenantTerms) -> Tenant:
        tenant = self.tenants.get(terms.name)
        if tenant is None:
            tenant = self.tenants[terms.name] = Tenant(terms, self.config.burst_s, self.replicas, self.clock)
        elif tenant.terms is not terms:  # the keys file was reloaded
            tenant.update(terms)
        return tenant

    def share(self, replicas: int) -> None:
        """Every tenant takes 1/`replicas` of its limits on this coordinator."""
        replicas = max(1, replicas)
        if replicas != self.replicas:
            self.replicas = replicas
            for tenant in self.tenants.values():
                tenant.share(replicas)


class Admission:
    """Tenant, limits, priority and drafting switch of each client request, applied before any of its generations
    queue."""

    def __init__(self, config: TenancyConfig, limits: ModelLimits, keys: ApiKeyStore | None = None,
                 fixed_drafting: str = ""):
        """`fixed_drafting`: the speculative method the decode instances run on every request, which no request
        can turn off (vLLM instances' `speculative`); empty: none, or a pdserve worker's, which a request can."""
        self.config = config
        self.limits = limits
        self.book = TenantBook(config, keys)
        # The default name is GIE's older one: the llm-d name is read first, as gateways send either.
        self.fairness_headers: tuple[str, ...] = ()
        if config.trust_fairness_header:
            self.fairness_headers = ((FAIRNESS_HEADER, OLD_FAIRNESS_HEADER)
                                     if config.fairness_header == OLD_FAIRNESS_HEADER else (config.fairness_header,))
        self.fixed_drafting = fixed_drafting

    def admit(self, http_request: web.Request, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        """`requests` (one client request's generations) with their tenant's ticket and their priority; ApiError
        400 for a bad header, 429 past the tenant's limits. Close the ticket when the client request ends."""
        headers = http_request.headers
        priority = self.header_priority(headers)
        no_drafts = self.header_no_drafts(headers)
        tenant = self.book.tenant(http_request.get(KEY_TERMS), self.header_tenant(headers))
        max_output = 0
        if tenant.tokens is not None:
            max_output = sum(self.limits.generation_cap(r.max_tokens, len(r.prompt_token_ids)) for r in requests)
        prompts = {id(r.prompt_token_ids): len(r.prompt_token_ids) for r in requests}  # n copies share a prompt
        ticket = tenant.admit(sum(prompts.values()), max_output, len(requests))
        return [dataclasses.replace(r, ticket=ticket, priority=r.priority or priority, no_drafts=no_drafts)
                for r in requests]

    def header_tenant(self, headers) -> str | None:
        header = next((h for h in self.fairness_headers if h in headers), None)
        if header is None:
            return None
        name = headers[header]
        if not _NAME.match(name):
            raise ApiError(400, f"header {header} must be 1-128 of A-Z a-z 0-9 . _ : @ / - (starting "
                                "with a letter or digit)", param=header)
        return name

    def header_priority(self, headers) -> int:
        """The priority level the headers ask for, DEFAULT_PRIORITY without any."""
        value = headers.get(PRIORITY_HEADER)
        if value is not None:
            if value.strip() not in ("1", "2", "3", "4", "5"):
                raise ApiError(400, f"header {PRIORITY_HEADER} must be a whole number in [1, 5] (1 first)",
                               param=PRIORITY_HEADER)
            return int(value)
        header = OBJECTIVE_HEADER if OBJECTIVE_HEADER in headers else OLD_OBJECTIVE_HEADER
        objective = headers.get(header)
        if objective is not None:
            level = self.config.objectives.get(objective)
            if level is None:
                known = ", ".join(sorted(self.config.objectives)) or "none are configured"
                raise ApiError(400, f"header {header} names an unknown objective; known: {known} "
                                    "(tenancy_config.objectives)", param=header)
            return level
        return DEFAULT_PRIORITY

    def header_no_drafts(self, headers) -> bool:
        """Whether the headers turn speculative drafting off (`x-pdserve-speculative: off`)."""
        value = headers.get(SPECULATIVE_HEADER)
        if value is None:
            return False
        value = value.strip().lower()
        if value not in ("on", "off"):
            raise ApiError(400, f"header {SPECULATIVE_HEADER} must be on or off (on, the default: the decode worker "
                                "may draft tokens speculatively; off: it does not)", param=SPECULATIVE_HEADER)
        if value == "off" and self.fixed_drafting:
            raise ApiError(400, f"header {SPECULATIVE_HEADER}: off cannot be honoured: the decode instances are vLLM "
                                f"engines running speculative decoding ({self.fixed_drafting}) on every request, and "
                                "the vLLM engine cannot turn drafting off per request; send on or leave the header "
                                "out", param=SPECULATIVE_HEADER)
        return value == "off"


def close_tickets(requests: list[GenerationRequest]) -> None:
    """End the client request's hold on its tenant (idempotent)."""
    ticket: TenantTicket | None = requests[0].ticket if requests else None
    if ticket is not None:
        ticket.close()


ADMISSION = web.AppKey("admission", Admission)
