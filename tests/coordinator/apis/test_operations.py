"""GET /health, GET /health/live and GET /v1/models against the running cluster."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.system


def test_health_is_200_when_every_worker_answers(http, cluster):
    resp = http.get("/health")
    assert resp.status_code == 200
    body = resp.json()
    assert body["status"] == "healthy"
    assert body["instances"]["prefill"] == {cluster.prefill.address: "healthy"}
    assert body["instances"]["decode"] == {cluster.decode.address: "healthy"}


def test_models_lists_the_served_model(http):
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["pdserve-tiny"]


def test_liveness_answers_on_both_ports(http, cluster):
    from tests.helpers import management_url

    assert http.get("/health/live").json() == {"status": "alive"}
    assert httpx.get(f"{management_url(cluster.coordinator)}/health/live", timeout=10).json() == {"status": "alive"}


def test_without_etcd_health_says_nothing_of_it(http):
    assert set(http.get("/health").json()) == {"status", "instances"}


def test_health_with_etcd_reports_the_role_and_a_standby_is_not_ready():
    from coordinator.apis.operations import health_body

    instances = {"prefill": [{"address": "a:1", "state": "healthy"}], "decode": [{"address": "b:1", "state": "healthy"}]}
    etcd = {"reachable": False, "since": 1.5, "error": "refused", "endpoints": ["http://e:2379"]}
    for role, status in (("active", 200), ("replica", 200), ("standby", 503)):
        cluster = {"role": role, "coordinator": "A", "leader": "A", "etcd": etcd}
        got, body = health_body(instances, cluster)
        assert (got, body["role"], body["etcd"], body["status"]) == (status, role, etcd, "healthy")
