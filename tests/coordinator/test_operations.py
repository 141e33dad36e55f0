"""GET /health and GET /v1/models against the running cluster."""

from __future__ import annotations

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
