"""Tenants and their limits: concurrent requests, requests per minute, prompt + output tokens per minute.

A client request is admitted once (`Tenant.admit`, whatever its number of generations) and holds a
TenantTicket until it ends:
  1. Admit: refused with 429 and Retry-After (from the bucket that refused) past the tenant's concurrency,
     rpm or tpm. Else it takes one request and its prompt tokens plus a reservation for its output (the
     tenant's recent mean answer, at most its max_tokens) from the buckets.
  2. Stream: each generation's Progress joins the ticket; the tokens it streams are charged when the tenant is
     next looked at (an admission, a scrape, the end), out of the reservation first.
  3. Close: the last tokens are charged and what is left of the reservation goes back.
Limits are the tenant's share on this coordinator: on etcd replicas each takes 1/N of every limit.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, NoReturn

from coordinator.errors import ApiError
from coordinator.tenancy.token_bucket import TokenBucket
from security.api_keys import TenantTerms

if TYPE_CHECKING:
    from coordinator.requests.attempt import Progress

OUTPUT_EWMA = 0.2  # weight of a finished request's output in the tenant's expected output
SETTLE_EVERY_S = 0.1  # an admission charges what streamed since the last settle, at most this often
REFUSALS = ("concurrency", "rpm", "tpm", "deadline")


class TenantTicket:
    """One admitted client request of a tenant: its output reservation and its generations' progress."""

    __slots__ = ("tenant", "reserved", "counted", "streams", "closed", "late")

    def __init__(self, tenant: Tenant, reserved: int):
        self.tenant = tenant
        self.reserved = reserved  # output tokens already taken from the tpm bucket, not yet streamed
        self.counted = 0  # output tokens charged so far
        self.streams: list[Progress] = []
        self.closed = False
        self.late = False  # refused for its deadline (counted once, whatever its number of generations)

    def settle(self) -> None:
        """Charge the tokens streamed since the last settle: out of the reservation first, then the bucket."""
        streamed = sum(p.count for p in self.streams)
        new = streamed - self.counted
        if new <= 0:
            return
        self.counted = streamed
        tenant = self.tenant
        tenant.output_tokens += new
        if tenant.tokens is not None:
            covered = min(new, self.reserved)
            self.reserved -= covered
            if new > covered:
                tenant.tokens.take(new - covered)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.settle()
        tenant = self.tenant
        tenant.open.discard(self)
        if tenant.tokens is not None and self.reserved:
            tenant.tokens.give_back(self.reserved)
        if self.counted:  # one that never generated (refused, or its client left) says nothing of answers
            outputs = self.counted / len(self.streams)
            tenant.expected_output += OUTPUT_EWMA * (outputs - tenant.expected_output)

    def refused_for_deadline(self) -> None:
        if not self.late:
            self.late = True
            self.tenant.refused["deadline"] += 1


class Tenant:
    """A tenant's terms (its share of them on this coordinator), buckets, requests in flight and counters."""

    def __init__(self, terms: TenantTerms, burst_s: float, replicas: int = 1, clock=time.monotonic):
        self.name = terms.name
        self.line = (terms.name, terms.weight)  # its place in the fair waiting line
        self.terms = terms
        self.burst_s = burst_s
        self.clock = clock
        self.open: set[TenantTicket] = set()  # its client requests in flight
        self.expected_output = 0.0
        self.admitted = 0
        self.refused = dict.fromkeys(REFUSALS, 0)
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.queue_seconds = 0.0
        self.queued = 0
        self._settled_at = -SETTLE_EVERY_S
        self.share(replicas)

    def share(self, replicas: int) -> None:
        """Take 1/`replicas` of each limit (the others take the rest); buckets keep their fill ratio. Concurrency
        rounds up: N replicas together may hold up to N - 1 requests more than the limit."""
        self.replicas = replicas
        terms = self.terms
        self.concurrency = math.ceil(terms.concurrency / replicas) if terms.concurrency else 0
        self.requests = self._bucket(terms.rpm / replicas, getattr(self, "requests", None))
        self.tokens = self._bucket(terms.tpm / replicas, getattr(self, "tokens", None))

    def _bucket(self, per_minute: float, old: TokenBucket | None) -> TokenBucket | None:
        if not per_minute:
            return None
        bucket = TokenBucket(per_minute, self.burst_s, self.clock)
        if old is not None:
            bucket.level = old.refill() / old.capacity * bucket.capacity
        return bucket

    def update(self, terms: TenantTerms) -> None:
        """New terms for the tenant (the keys file was reloaded)."""
        if terms != self.terms:
            self.terms = terms
            self.line = (terms.name, terms.weight)
            self.share(self.replicas)

    @property
    def in_flight(self) -> int:
        return len(self.open)

    def settle(self) -> None:
        for ticket in self.open:
            ticket.settle()
        self._settled_at = self.clock()

    def settle_if_due(self) -> None:
        """Settle, unless done within SETTLE_EVERY_S: a flood's admissions would each walk all its open tickets,
        for tokens that move the bucket by a tenth of a second's streaming at most."""
        if self.clock() - self._settled_at >= SETTLE_EVERY_S:
            self.settle()

    def admit(self, prompt_tokens: int, max_output: int, generations: int = 1) -> TenantTicket:
        """A ticket for a client request of `prompt_tokens` (all its prompts) whose `generations` may generate
        `max_output` tokens in all; ApiError 429 with Retry-After past a limit."""
        if self.concurrency and self.in_flight >= self.concurrency:
            self._refuse("concurrency", 1, f"{self.in_flight} requests in flight; its limit is {self.concurrency}"
                         f"{self._per_replica}")
        if self.requests is not None and not self.requests.can_take(1):
            self._refuse("rpm", self.requests.wait_s(1), f"over its {self.terms.rpm} requests per minute"
                         f"{self._per_replica}")
        reserved = 0
        if self.tokens is not None:
            self.settle_if_due()
            reserved = min(max_output, round(self.expected_output * generations))
            need = prompt_tokens + reserved
            if not self.tokens.can_take(need):
                self._refuse("tpm", self.tokens.wait_s(need), f"over its {self.terms.tpm} tokens per minute"
                             f"{self._per_replica}")
            self.tokens.take(need)
        if self.requests is not None:
            self.requests.take(1)
        self.admitted += 1
        self.prompt_tokens += prompt_tokens
        ticket = TenantTicket(self, reserved)
        self.open.add(ticket)
        return ticket

    @property
    def _per_replica(self) -> str:
        return f" (this coordinator's 1/{self.replicas} share)" if self.replicas > 1 else ""

    def _refuse(self, reason: str, retry_after_s: int, why: str) -> NoReturn:
        self.refused[reason] += 1
        raise ApiError(429, f"tenant {self.name}: {why}; retry after {retry_after_s}s",
                       headers={"Retry-After": str(retry_after_s)})
