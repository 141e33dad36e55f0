"""Admission: the tenant of a request (key, trusted fairness header, anonymous) and its priority headers."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request

from coordinator.errors import ApiError
from coordinator.requests.limits import ModelLimits
from coordinator.requests.request import GenerationRequest, SamplingOptions
from coordinator.tenancy.admission import KEY_TERMS, OVERFLOW, Admission
from coordinator.tenancy.settings import TenancyConfig
from security.api_keys import ApiKeyStore, TenantTerms, hash_key

LIMITS = ModelLimits(max_seq_len=2048, max_input_token_len=1024, max_iter_times=100, max_position_embeddings=2048)


def http(headers: dict | None = None, key_terms: TenantTerms | None = None):
    request = make_mocked_request("POST", "/v1/completions", headers=headers or {})
    if key_terms is not None:
        request[KEY_TERMS] = key_terms
    return request


def gen(priority: int | None = None, prompt: list[int] | None = None) -> GenerationRequest:
    return GenerationRequest("r", prompt or [1, 2, 3], SamplingOptions(), max_tokens=20, priority=priority)


def test_a_request_without_a_key_or_header_is_the_anonymous_tenants_at_priority_5():
    admission = Admission(TenancyConfig(), LIMITS)
    (admitted,) = admission.admit(http(), [gen()])
    assert admitted.ticket.tenant.name == "anonymous" and admitted.priority == 5
    assert admitted.ticket.tenant.in_flight == 1
    admitted.ticket.close()
    assert admitted.ticket.tenant.in_flight == 0


def test_the_keys_tenant_carries_its_terms_and_copies_of_a_prompt_count_once():
    admission = Admission(TenancyConfig(), LIMITS)
    terms = TenantTerms("team-a", weight=2.0, tpm=100_000)
    prompt = [7] * 30
    admitted = admission.admit(http(key_terms=terms), [gen(prompt=prompt), gen(prompt=prompt)])
    tenant = admitted[0].ticket.tenant
    assert admitted[0].ticket is admitted[1].ticket and tenant.line == ("team-a", 2.0)
    assert tenant.prompt_tokens == 30


@pytest.mark.parametrize("headers,level", [
    ({"x-pdserve-priority": "1"}, 1),
    ({"x-gateway-inference-objective": "critical"}, 2),
    ({"x-gateway-inference-objective": "critical", "x-pdserve-priority": "4"}, 4),
    ({"x-llm-d-inference-objective": "batch"}, 5),
    ({"x-llm-d-inference-objective": "critical", "x-gateway-inference-objective": "batch"}, 2),  # llm-d's first
    ({}, 5),
])
def test_priority_headers_map_onto_levels_1_to_5(headers, level):
    admission = Admission(TenancyConfig(objectives={"critical": 2, "batch": 5}), LIMITS)
    assert admission.admit(http(headers), [gen()])[0].priority == level


def test_a_body_priority_wins_over_the_headers():
    admission = Admission(TenancyConfig(), LIMITS)
    assert admission.admit(http({"x-pdserve-priority": "1"}), [gen(priority=3)])[0].priority == 3


@pytest.mark.parametrize("headers,param", [
    ({"x-pdserve-priority": "0"}, "x-pdserve-priority"),
    ({"x-pdserve-priority": "high"}, "x-pdserve-priority"),
    ({"x-gateway-inference-objective": "unknown"}, "x-gateway-inference-objective"),
    ({"x-llm-d-inference-objective": "unknown"}, "x-llm-d-inference-objective"),
    ({"x-pdserve-speculative": "maybe"}, "x-pdserve-speculative"),
    ({"x-pdserve-speculative": ""}, "x-pdserve-speculative"),
])
def test_a_bad_priority_or_speculative_header_is_a_400_naming_it(headers, param):
    admission = Admission(TenancyConfig(objectives={"critical": 1}), LIMITS)
    with pytest.raises(ApiError) as refused:
        admission.admit(http(headers), [gen()])
    assert refused.value.status == 400 and refused.value.param == param


def test_a_trusted_fairness_header_names_the_tenant_with_the_keys_file_terms_or_the_defaults(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"{hash_key('k')} name=gold weight=4 rpm=100\n")
    config = TenancyConfig(trust_fairness_header=True, default_rpm=30, max_tenants=2)
    admission = Admission(config, LIMITS, ApiKeyStore.load(path))
    gateway = TenantTerms("gateway")
    def tenant(name):
        return admission.admit(http({"x-gateway-inference-fairness-id": name}, gateway), [gen()])[0].ticket.tenant
    gold, other = tenant("gold"), tenant("user-1")
    assert (gold.name, gold.terms.weight, gold.terms.rpm) == ("gold", 4.0, 100)
    assert (other.name, other.terms.rpm) == ("user-1", 30)
    assert tenant("user-2").name == "user-2" and tenant("user-3").name == OVERFLOW  # past max_tenants
    assert tenant("user-1") is other
    with pytest.raises(ApiError) as refused:
        tenant("bad name!")
    assert refused.value.status == 400


def test_llm_ds_fairness_header_names_the_tenant_before_the_older_gie_name():
    admission = Admission(TenancyConfig(trust_fairness_header=True), LIMITS)
    headers = {"x-llm-d-inference-fairness-id": "new", "x-gateway-inference-fairness-id": "old"}
    assert admission.admit(http(headers), [gen()])[0].ticket.tenant.name == "new"
    assert admission.admit(http({"x-gateway-inference-fairness-id": "old"}), [gen()])[0].ticket.tenant.name == "old"
    with pytest.raises(ApiError) as refused:
        admission.admit(http({"x-llm-d-inference-fairness-id": "bad name!"}), [gen()])
    assert refused.value.param == "x-llm-d-inference-fairness-id"


def test_an_untrusted_fairness_header_is_not_read():
    admission = Admission(TenancyConfig(), LIMITS)
    terms = TenantTerms("team-a")
    (admitted,) = admission.admit(http({"x-gateway-inference-fairness-id": "someone"}, terms), [gen()])
    assert admitted.ticket.tenant.name == "team-a"


def test_replicas_divide_every_tenants_limits():
    admission = Admission(TenancyConfig(), LIMITS)
    tenant = admission.admit(http(key_terms=TenantTerms("a", rpm=120)), [gen()])[0].ticket.tenant
    admission.book.share(3)
    assert tenant.requests.rate == pytest.approx(120 / 60 / 3)
    late = admission.admit(http(key_terms=TenantTerms("b", concurrency=4)), [gen()])[0].ticket.tenant
    assert late.concurrency == 2


@pytest.mark.parametrize("headers,no_drafts", [
    ({}, False),
    ({"x-pdserve-speculative": "on"}, False),
    ({"x-pdserve-speculative": "off"}, True),
    ({"x-pdserve-speculative": " OFF "}, True),
])
def test_the_speculative_header_turns_drafting_off_for_every_generation_of_the_request(headers, no_drafts):
    admission = Admission(TenancyConfig(), LIMITS)
    admitted = admission.admit(http(headers), [gen(), gen()])
    assert [r.no_drafts for r in admitted] == [no_drafts, no_drafts]


def test_off_is_refused_naming_the_header_where_vllm_decode_instances_draft_on_every_request():
    admission = Admission(TenancyConfig(), LIMITS, fixed_drafting="ngram")
    with pytest.raises(ApiError) as refused:
        admission.admit(http({"x-pdserve-speculative": "off"}), [gen()])
    assert refused.value.status == 400 and refused.value.param == "x-pdserve-speculative"
    assert "vLLM engine cannot turn drafting off per request" in refused.value.message
    assert admission.admit(http({"x-pdserve-speculative": "on"}), [gen()])[0].no_drafts is False
