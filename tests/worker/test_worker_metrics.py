"""Each worker's Prometheus endpoint: transfer, step and budget metrics move as a request runs."""

from __future__ import annotations

import pytest
from tests.helpers import metrics_url, scrape


pytestmark = pytest.mark.system


def test_worker_metrics_move_as_a_request_runs(http, cluster):
    p_url, d_url = metrics_url(cluster.prefill), metrics_url(cluster.decode)
    p0, d0 = scrape(p_url), scrape(d_url)
    resp = http.post("/v1/completions", json={"model": "pdserve-tiny", "prompt": "Hello there", "max_tokens": 6,
                                              "temperature": 0})
    assert resp.status_code == 200
    p1, d1 = scrape(p_url), scrape(d_url)

    def delta(before, after, name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    sent = delta(p0, p1, "pdserve_kv_transfer_bytes_total", side="send", transport="tcp")
    assert sent > 0 and delta(d0, d1, "pdserve_kv_transfer_bytes_total", side="receive", transport="tcp") == sent
    assert delta(p0, p1, "pdserve_kv_transfer_duration_seconds_count", side="send", transport="tcp") == 1
    assert delta(d0, d1, "pdserve_kv_transfer_duration_seconds_count", side="receive", transport="tcp") == 1
    assert delta(p0, p1, "pdserve_worker_step_duration_seconds_count", kind="prefill") == 1
    assert delta(d0, d1, "pdserve_worker_step_duration_seconds_count", kind="decode") == 5
    assert delta(d0, d1, "pdserve_worker_batch_size_count", kind="decode") == 5
    assert p1[("pdserve_worker_kv_budget_used_tokens", ())] == 0 and p1[("pdserve_worker_kv_leases", ())] == 0
    assert d1[("pdserve_worker_running_sequences", ())] == 0
    assert d1[("pdserve_worker_kv_budget_capacity_tokens", ())] > 0
