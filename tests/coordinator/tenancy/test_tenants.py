"""Tenant: concurrency, rpm and tpm limits with Retry-After, output charged as it streams, shares per replica."""

from __future__ import annotations

import pytest

from coordinator.errors import ApiError
from coordinator.requests.attempt import Progress
from coordinator.tenancy.tenants import Tenant
from security.api_keys import TenantTerms


class Clock:
    def __init__(self):
        self.now = 10.0

    def __call__(self):
        return self.now


def refusal(tenant: Tenant, prompt: int = 10, output: int = 10) -> ApiError:
    with pytest.raises(ApiError) as refused:
        tenant.admit(prompt, output)
    assert refused.value.status == 429
    return refused.value


def test_past_its_concurrency_a_tenant_is_refused_until_a_request_ends():
    tenant = Tenant(TenantTerms("a", concurrency=2), burst_s=6)
    first, _ = tenant.admit(5, 5), tenant.admit(5, 5)
    error = refusal(tenant)
    assert "2 requests in flight; its limit is 2" in error.message and error.headers == {"Retry-After": "1"}
    first.close()
    first.close()  # closing twice releases once
    tenant.admit(5, 5)
    assert (tenant.in_flight, tenant.admitted, tenant.refused["concurrency"]) == (2, 3, 1)


def test_past_its_rpm_the_retry_after_is_when_the_bucket_holds_a_request_again():
    clock = Clock()
    tenant = Tenant(TenantTerms("a", rpm=60), burst_s=3, clock=clock)  # 1 a second, 3 at once
    for _ in range(3):
        tenant.admit(1, 1).close()
    error = refusal(tenant)
    assert error.headers == {"Retry-After": "1"} and "60 requests per minute" in error.message
    clock.now += 1
    tenant.admit(1, 1)
    assert tenant.refused["rpm"] == 1


def test_tokens_streamed_are_charged_out_of_the_reservation_first_and_the_rest_is_given_back():
    clock = Clock()
    tenant = Tenant(TenantTerms("a", tpm=6000), burst_s=10, clock=clock)  # 100 a second, 1000 at most
    tenant.expected_output = 200
    ticket = tenant.admit(100, 500)
    assert ticket.reserved == 200 and tenant.tokens.level == 700  # prompt + the expected answer
    stream = Progress()
    ticket.streams.append(stream)
    stream.token_ids.extend(range(150))
    tenant.settle()
    assert (ticket.reserved, tenant.tokens.level, tenant.output_tokens) == (50, 700, 150)
    stream.token_ids.extend(range(100))  # 250 in all: 50 past the reservation
    tenant.settle()
    assert (ticket.reserved, tenant.tokens.level) == (0, 650)
    ticket.close()
    assert tenant.tokens.level == 650 and tenant.expected_output == pytest.approx(200 + 0.2 * 50)
    short = tenant.admit(0, 300)
    short.close()  # nothing streamed: its whole reservation comes back
    assert tenant.tokens.level == 650


def test_past_its_tpm_the_retry_after_is_when_the_request_fits_again():
    clock = Clock()
    tenant = Tenant(TenantTerms("a", tpm=600), burst_s=60, clock=clock)  # 10 a second, 600 at most
    ticket = tenant.admit(550, 100)
    stream = Progress(token_ids=list(range(100)))
    ticket.streams.append(stream)
    assert tenant.admit(0, 0) is not None  # within 0.1 s of the last settle: what streamed is not counted yet
    clock.now += 0.2
    error = refusal(tenant, prompt=100)  # now it is, before the admission: level -48
    assert error.headers == {"Retry-After": "15"} and "600 tokens per minute" in error.message
    clock.now += 15
    tenant.admit(100, 0)


def test_on_replicas_each_takes_its_share_of_every_limit():
    clock = Clock()
    tenant = Tenant(TenantTerms("a", rpm=120, tpm=1200, concurrency=3), burst_s=6, clock=clock)
    tenant.share(2)
    assert tenant.concurrency == 2 and tenant.requests.rate == 1.0 and tenant.tokens.rate == 10.0
    error = None
    for _ in range(7):
        try:
            tenant.admit(1, 0).close()
        except ApiError as exc:
            error = exc
    assert error is not None and "1/2 share" in error.message  # 6 at once: 6 s of 1 a second


def test_new_terms_take_effect_on_the_same_tenant():
    tenant = Tenant(TenantTerms("a", concurrency=1), burst_s=6)
    tenant.admit(1, 1)
    refusal(tenant)
    tenant.update(TenantTerms("a", weight=2.0, concurrency=2))
    tenant.admit(1, 1)
    assert tenant.line == ("a", 2.0)
