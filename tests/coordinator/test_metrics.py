"""Prometheus metrics: scraped from the coordinator's predict and management ports, moving as requests run."""

from __future__ import annotations

import pytest
from tests.helpers import scrape



pytestmark = pytest.mark.system


def test_request_metrics_move_as_requests_run(http, cluster):
    before = scrape(cluster.url)
    assert http.post("/v1/completions", json={"model": "pdserve-tiny", "prompt": "Hi", "max_tokens": 5}).status_code == 200
    assert http.post("/v1/completions", json={"model": "pdserve-tiny", "prompt": "Hi", "top_p": 0}).status_code == 400
    after = scrape(cluster.url)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("pdserve_requests_received_total", api="openai_completions") == 2
    assert delta("pdserve_requests_finished_total", api="openai_completions", status="200") == 1
    assert delta("pdserve_requests_finished_total", api="openai_completions", status="400") == 1
    assert delta("pdserve_generation_tokens_total") == 5
    assert delta("pdserve_prompt_tokens_total") >= 1
    assert delta("pdserve_time_to_first_token_seconds_count") == 1
    assert delta("pdserve_time_per_output_token_seconds_count") == 4
    assert delta("pdserve_e2e_request_latency_seconds_count", api="openai_completions") == 2
    assert after[("pdserve_requests_running", ())] == 0
    assert delta("pdserve_requests_failed_total", api="openai_completions", reason="bad_request") == 1
    assert delta("pdserve_request_queue_time_seconds_count") == 1
    assert after[("pdserve_requests_waiting", ())] == 0


def test_instance_health_and_outstanding_work_are_exported(http, cluster):
    values = scrape(cluster.url)
    for role, proc in (("prefill", cluster.prefill), ("decode", cluster.decode)):
        assert values[("pdserve_instance_healthy", (("address", proc.address), ("role", role),
                                                    ("state", "healthy")))] == 1
        assert values[("pdserve_instance_outstanding_requests", (("address", proc.address), ("role", role)))] == 0
