"""A client request's root span, made by the request gate around every client API call."""

from __future__ import annotations

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from coordinator.http.request_gate import InFlightLimit, RequestGate
from coordinator.metrics import METRICS, CoordinatorMetrics
from coordinator.http.route_table import ROUTE_TABLE, ErrorStyle, Route, RouteTable

CLIENT_TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


async def ok(request: web.Request) -> web.Response:
    return web.json_response({})


def traced_app() -> web.Application:
    metrics = CoordinatorMetrics()
    table = RouteTable([Route("POST", "/v2/models/{model}/generate", ok, ErrorStyle.TGI, "triton")])
    app = web.Application(middlewares=[RequestGate(table, metrics, InFlightLimit(8)).middleware])
    app[ROUTE_TABLE] = table
    app[METRICS] = metrics
    app[ROUTE_TABLE].add_to(app)
    return app


async def test_a_requests_span_is_named_by_its_route_template_and_joins_the_clients_trace(span_exporter):
    async with TestClient(TestServer(traced_app())) as client:
        resp = await client.post("/v2/models/pdserve-tiny/generate", json={},
                                 headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
        assert resp.status == 200
    [root] = span_exporter.get_finished_spans()
    assert root.name == "POST /v2/models/{model}/generate"
    assert f"{root.context.trace_id:032x}" == CLIENT_TRACE and f"{root.parent.span_id:016x}" == CLIENT_SPAN
    assert root.attributes["http.response.status_code"] == 200


async def test_an_unrouted_requests_span_is_named_by_its_method_alone(span_exporter):
    async with TestClient(TestServer(traced_app())) as client:
        resp = await client.post("/no/such/route", json={})
        assert resp.status == 404
    [root] = span_exporter.get_finished_spans()
    assert root.name == "POST" and root.attributes["http.response.status_code"] == 404
