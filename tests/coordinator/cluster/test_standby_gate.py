"""StandbyGate in an app: a standby's client APIs answer 503 with Retry-After in their own error bodies."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from coordinator.http.request_gate import InFlightLimit, RequestGate
from coordinator.metrics import METRICS, CoordinatorMetrics
from coordinator.cluster.standby_gate import StandbyGate
from coordinator.http.route_table import ROUTE_TABLE, ErrorStyle, Route, RouteTable
from coordinator.http.routes import PREDICT_ROUTES


async def ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


@pytest.fixture
async def gated():
    leadership = SimpleNamespace(serving=False, leader="A")
    table = RouteTable([Route("POST", "/v1/completions", ok, ErrorStyle.OPENAI),
                        Route("POST", "/generate", ok, ErrorStyle.TGI),
                        Route("GET", "/health", ok, ErrorStyle.TGI, on_standby=True)])
    metrics = CoordinatorMetrics()
    app = web.Application(middlewares=[RequestGate(table, metrics, InFlightLimit(8),
                                                   standby=StandbyGate(leadership)).middleware])
    app[ROUTE_TABLE] = table
    app[METRICS] = metrics
    app[ROUTE_TABLE].add_to(app)
    async with TestClient(TestServer(app)) as client:
        yield client, leadership


async def test_a_standby_refuses_each_client_api_in_its_own_error_body(gated):
    client, _ = gated
    openai = await client.post("/v1/completions", json={})
    assert openai.status == 503 and openai.headers["Retry-After"] == "1"
    body = await openai.json()
    assert body["error"]["type"] == "service_unavailable" and "standby" in body["error"]["message"]
    assert "A" in body["error"]["message"]
    tgi = await client.post("/generate", json={})
    assert tgi.status == 503 and tgi.headers["Retry-After"] == "1"
    assert (await tgi.json())["error_type"] == "service_unavailable"


async def test_a_standby_still_answers_health(gated):
    client, _ = gated
    assert (await client.get("/health")).status == 200
    assert (await client.head("/health")).status == 200


async def test_an_active_coordinator_passes_everything(gated):
    client, leadership = gated
    leadership.serving = True
    assert (await client.post("/v1/completions", json={})).status == 200


def test_only_health_liveness_and_metrics_answer_on_a_standby():
    open_routes = {(r.method, r.path) for r in PREDICT_ROUTES.routes if r.on_standby}
    assert open_routes == {("GET", "/health"), ("GET", "/health/live"), ("GET", "/metrics")}
