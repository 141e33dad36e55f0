"""Tenants on a real coordinator over simulated workers: limits answered with 429 and Retry-After in each API's
format, a flooding tenant waiting behind itself, priority headers, and requests refused before their deadline."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from security.api_keys import hash_key
from tests.helpers import scrape, start_coordinator, start_sim_worker, wait_for, write_config

pytestmark = pytest.mark.system

FLOOD, LIGHT, LIMITED = "sk-flood-1a2b", "sk-light-3c4d", "sk-limited-5e6f"
# 5 ms a decode step: a 40-token answer holds its turn for about 0.2 s.
SLOW = ("--sim-decode-base-ms", "5")


def tenant_metric(url: str, name: str, tenant: str, **labels) -> float:
    key = (name, tuple(sorted({"tenant": tenant, **labels}.items())))
    return scrape(url).get(key, 0.0)


@pytest.fixture(scope="module")
def tenants(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    (tmp / "keys").write_text(f"{hash_key(FLOOD)} name=flood\n{hash_key(LIGHT)} name=light weight=1\n"
                              f"{hash_key(LIMITED)} name=limited rpm=30 concurrency=2  # 3 at once, then 1 in 2 s\n")
    workers = [start_sim_worker("prefill"), start_sim_worker("decode", *SLOW)]
    sections = {"auth_config": {"api_keys_file": "keys"}, "request_limit": {"max_running": 1},
                "tenancy_config": {"objectives": {"critical": 1}}}
    coordinator = start_coordinator(write_config(tmp / "ms_coordinator.json", [workers[0].address],
                                                 [workers[1].address], model_dir, sections=sections,
                                                 maxIterTimes=500, maxSeqLen=1024, maxInputTokenLen=512))
    yield coordinator
    assert [p.stop() for p in (coordinator, *workers)] == [0, 0, 0]


def complete(url: str, key: str, max_tokens: int = 40, headers: dict | None = None, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, headers={"Authorization": f"Bearer {key}", **(headers or {})},
                      json={"model": "pdserve-tiny", "prompt": "tell me", "max_tokens": max_tokens,
                            "ignore_eos": True, **body})


def test_past_its_rpm_a_tenant_gets_429_with_retry_after_in_each_apis_format_and_retrying_then_succeeds(tenants):
    url = tenants.address
    statuses = [complete(url, LIMITED, max_tokens=2).status_code for _ in range(3)]
    assert statuses == [200, 200, 200]  # its bucket holds 6 s of 30 a minute
    refused = complete(url, LIMITED, max_tokens=2)
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert "tenant limited" in refused.json()["error"]["message"] and LIMITED not in refused.text
    retry_after = int(refused.headers["Retry-After"])
    assert 1 <= retry_after <= 2
    tgi = httpx.post(f"{url}/generate", timeout=30, headers={"Authorization": f"Bearer {LIMITED}"},
                     json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    assert tgi.status_code == 429 and tgi.json()["error_type"] == "rate_limit_error" and "Retry-After" in tgi.headers
    time.sleep(retry_after)  # the protocol: come back after Retry-After
    assert complete(url, LIMITED, max_tokens=2).status_code == 200
    assert tenant_metric(url, "pdserve_tenant_requests_refused_total", "limited", reason="rpm") == 2
    assert tenant_metric(url, "pdserve_tenant_requests_admitted_total", "limited") == 4
    assert tenant_metric(url, "pdserve_tenant_tokens_total", "limited", kind="output") == 8


def test_a_flooding_tenant_waits_behind_its_own_requests_not_in_front_of_another_tenants(tenants):
    url = tenants.address
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        # Long answers: the line stays deep while the test looks (it waits on the line's own count).
        flood = [pool.submit(complete, url, FLOOD, 100) for _ in range(20)]
        wait_for(lambda: scrape(url)[("pdserve_requests_waiting", ())] >= 15, what="the flood to queue")
        queued_before = tenant_metric(url, "pdserve_tenant_queued_total", "flood")
        light = complete(url, LIGHT)
        # By the time the light tenant's request has been served, few of the flood's waiting ones have started.
        flood_started = tenant_metric(url, "pdserve_tenant_queued_total", "flood") - queued_before
        assert light.status_code == 200
        assert flood_started <= 3, f"{flood_started} flood requests went first"
        assert all(f.result().status_code == 200 for f in flood)
    waited = scrape(url)
    light_wait = waited[("pdserve_tenant_queue_seconds_total", (("tenant", "light"),))]
    flood_wait = waited[("pdserve_tenant_queue_seconds_total", (("tenant", "flood"),))] / 20
    assert light_wait < flood_wait


def test_priority_headers_order_the_line_and_a_bad_one_is_a_400_in_the_apis_format(tenants):
    url = tenants.address
    bad = complete(url, FLOOD, headers={"x-pdserve-priority": "9"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-pdserve-priority"
    unknown = httpx.post(f"{url}/generate", timeout=30, headers={"Authorization": f"Bearer {FLOOD}",
                                                               "x-gateway-inference-objective": "gold"},
                         json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    assert unknown.status_code == 400 and "x-gateway-inference-objective" in unknown.json()["error"]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        low = [pool.submit(complete, url, FLOOD, 100) for _ in range(8)]
        wait_for(lambda: scrape(url)[("pdserve_requests_waiting", ())] >= 6, what="the requests to queue")
        urgent = pool.submit(complete, url, FLOOD, headers={"x-gateway-inference-objective": "critical"})
        urgent_done = urgent.result()
        finished_low = sum(f.done() for f in low)
        assert urgent_done.status_code == 200 and finished_low <= 3
        assert all(f.result().status_code == 200 for f in low)


def test_under_overload_with_2s_timeouts_each_request_is_served_or_refused_early_none_times_out(tenants):
    url = tenants.address
    for _ in range(3):  # finished requests tell the line their service time
        assert complete(url, LIGHT, max_tokens=20).status_code == 200

    def mindie():
        started = time.monotonic()
        resp = httpx.post(f"{url}/infer", timeout=60, headers={"Authorization": f"Bearer {FLOOD}"},
                          json={"inputs": "hi", "parameters": {"max_new_tokens": 20, "timeout": 2}})
        return resp, time.monotonic() - started

    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        results = [f.result() for f in [pool.submit(mindie) for _ in range(40)]]
    statuses = [resp.status_code for resp, _ in results]
    # MindIE's API, of TGI's family, answers an overloaded line with 429 (OpenAI-style APIs with 503); never 504.
    assert set(statuses) <= {200, 429} and statuses.count(200) >= 3 and statuses.count(429) >= 5, statuses
    for resp, _ in results:
        if resp.status_code == 429:
            assert resp.headers["Retry-After"].isdigit() and resp.json()["error_type"] == "overloaded"
    assert tenant_metric(url, "pdserve_tenant_requests_refused_total", "flood", reason="deadline") == \
        statuses.count(429)
