"""deploy/grafana/pdserve-dashboard.json imports cleanly, and every query names metrics, labels and label values
that a running cluster's /metrics really carries: a renamed metric or label shows up here, not as an empty panel."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import REPO, metrics_url, start_worker

DASHBOARD = REPO / "deploy" / "grafana" / "pdserve-dashboard.json"
# Prometheus adds these to every series when it scrapes, so no /metrics output carries them.
TARGET_LABELS = {"job", "instance"}

SELECTOR = re.compile(r"\b(pdserve_[a-z0-9_]+)(\{[^}]*\})?")
GROUPING = re.compile(r"\bby\s*\(([^)]*)\)")
MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def query_panels(dashboard: dict) -> list[dict]:
    """Every panel that queries, those inside collapsed rows included."""
    panels = []
    for panel in dashboard["panels"]:
        panels += panel.get("panels", []) if panel["type"] == "row" else [panel]
    return panels


def queries(dashboard: dict) -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in query_panels(dashboard) for target in panel["targets"]]


def references(expr: str) -> list[tuple[str, set[str], dict[str, set[str]]]]:
    """(series name, label names it must carry, label -> values it must have) for each series in a query.
    Every `by (...)` label of the query is asked of every series in it (the dashboard's queries aggregate each
    series they name by the same labels)."""
    grouped = {label.strip() for labels in GROUPING.findall(expr) for label in labels.split(",") if label.strip()}
    found = []
    for name, selector in SELECTOR.findall(expr):
        matchers = MATCHER.findall(selector)
        values = {label: set(value.split("|")) for label, op, value in matchers
                  if op in ("=", "=~") and re.fullmatch(r"[a-zA-Z0-9_|]+", value)}
        found.append((name, (grouped | {label for label, _, _ in matchers}) - TARGET_LABELS, values))
    return found


def test_dashboard_panels_have_unique_ids_and_queries():
    dashboard = load_dashboard()
    ids = [panel["id"] for top in dashboard["panels"] for panel in [top, *top.get("panels", [])]]
    assert len(ids) == len(set(ids)), ids
    for panel in query_panels(dashboard):
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert SELECTOR.search(target["expr"]), f"{panel['title']!r}: {target['expr']} names no pdserve metric"


def test_dashboard_queries_the_datasource_variable_it_declares():
    dashboard = load_dashboard()
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["uid"]
    (variable,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert variable["query"] == "prometheus"
    # Every panel and query on the variable, so the dashboard works with whichever Prometheus is picked on import.
    expected = {"type": "prometheus", "uid": f"${{{variable['name']}}}"}
    for panel in query_panels(dashboard):
        assert panel["datasource"] == expected, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == expected, panel["title"]


def live_series(urls: list[str]) -> dict[str, dict[str, set[str]]]:
    """Every series name in the scraped outputs -> label -> the values seen."""
    series: dict[str, dict[str, set[str]]] = {}
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = series.setdefault(sample.name, {})
                for label, value in sample.labels.items():
                    labels.setdefault(label, set()).add(value)
    return series


@pytest.mark.system
def test_dashboard_queries_name_only_series_and_labels_a_running_cluster_exports(http, cluster, vlm_dir):
    # Traffic first: labelled series (e2e latency by api, failures by reason, worker steps by kind) appear
    # only once something has been observed under their labels.
    body = {"model": "pdserve-tiny", "prompt": "Hello there", "max_tokens": 4}
    assert http.post("/v1/completions", json=body).status_code == 200
    with http.stream("POST", "/v1/chat/completions", json={
            "model": "pdserve-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "stream": True}) as stream:
        assert stream.status_code == 200
        assert "data: [DONE]" in stream.read().decode()
    assert http.post("/v1/completions", json={**body, "top_p": 0}).status_code == 400
    # An encode worker (the embedded vision-language model's): its encoder queue and cache series are its own.
    encoder = start_worker("encode", vlm_dir)
    try:
        live = live_series([cluster.url, metrics_url(cluster.prefill), metrics_url(cluster.decode),
                            metrics_url(encoder)])
    finally:
        encoder.stop()

    problems = []
    for title, expr in queries(load_dashboard()):
        for name, labels, values in references(expr):
            if name not in live:
                problems.append(f"{title!r}: {name} is not exported")
                continue
            missing = labels - set(live[name])
            if missing:
                problems.append(f"{title!r}: {name} has no label {sorted(missing)}")
            for label, wanted in values.items():
                absent = wanted - live[name].get(label, set())
                if absent:
                    problems.append(f"{title!r}: {name}{{{label}}} never takes {sorted(absent)}")
    assert not problems, "\n".join(problems)
