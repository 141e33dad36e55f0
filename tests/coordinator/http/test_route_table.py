"""The route table: one entry per route, and the app, error bodies, limits and metrics all follow it."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from coordinator.http.route_table import ROUTE_TABLE, ErrorStyle, Route, RouteTable
from coordinator.http.app import create_app
from coordinator.http.request_gate import InFlightLimit, RequestGate
from coordinator.config import parse_config
from coordinator.errors import ApiError
from coordinator.metrics import METRICS, CoordinatorMetrics
from coordinator.http.routes import PREDICT_ROUTES


async def refuse(request: web.Request) -> web.Response:
    raise ApiError(400, "refused", param="x")


async def ok(request: web.Request) -> web.Response:
    return web.json_response({})


def test_every_predict_route_has_a_unique_method_and_path():
    keys = [(r.method, r.path) for r in PREDICT_ROUTES.routes]
    assert len(keys) == len(set(keys))


def test_a_route_declared_twice_is_refused():
    route = Route("POST", "/x", ok, ErrorStyle.TGI, "x")
    with pytest.raises(ValueError, match="declared twice"):
        RouteTable([route, route])


def test_the_app_registers_exactly_the_route_table(model_dir):
    app = create_app(parse_config({"model_config": {"modelWeightPath": str(model_dir)}}))
    registered = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    assert registered == {(r.method, r.path) for r in PREDICT_ROUTES.routes}
    assert app[ROUTE_TABLE] is PREDICT_ROUTES


def test_generation_routes_are_the_posts_that_generate():
    generation = {r.path for r in PREDICT_ROUTES.routes if r.generation}
    assert generation == {"/v1/chat/completions", "/v1/completions", "/generate", "/generate_stream", "/", "/infer",
                          "/v2/models/{model}/generate", "/v2/models/{model}/generate_stream",
                          "/v2/models/{model}/infer"}


@pytest.mark.parametrize("method,path,style,label,generation", [
    ("POST", "/v1/chat/completions", ErrorStyle.OPENAI, "openai_chat", True),
    ("POST", "/v1/completions", ErrorStyle.OPENAI, "openai_completions", True),
    ("POST", "/v1/tokenizer", ErrorStyle.TGI, "tokenizer", False),
    ("GET", "/v1/tokenizer", ErrorStyle.TGI, None, False),  # wrong method: the path's style, not counted
    ("POST", "/generate", ErrorStyle.TGI, "generate", True),
    ("POST", "/", ErrorStyle.TGI, "tgi", True),
    ("POST", "/v2/models/any-model/generate_stream", ErrorStyle.TGI, "triton", True),
    ("POST", "/v2/models/a/b/infer", ErrorStyle.TGI, "other", False),  # `{model}` is one segment
    ("GET", "/v1/models", ErrorStyle.OPENAI, None, False),
    ("POST", "/v1/models", ErrorStyle.OPENAI, "other", False),
    ("GET", "/v1/nothing", ErrorStyle.OPENAI, None, False),
    ("POST", "/nothing", ErrorStyle.TGI, "other", False),
])
def test_lookups_by_method_and_path(method, path, style, label, generation):
    assert PREDICT_ROUTES.error_style(path) is style
    assert PREDICT_ROUTES.metrics_label(method, path) == label
    route = PREDICT_ROUTES.find(method, path)
    assert (route is not None and route.generation) is generation


def serve_table(table: RouteTable, max_requests: int = 8):
    """The predict app's middleware around `table`, served in this process."""
    metrics = CoordinatorMetrics()
    app = web.Application(middlewares=[RequestGate(table, metrics, InFlightLimit(max_requests)).middleware])
    app[ROUTE_TABLE] = table
    app[METRICS] = metrics
    table.add_to(app)
    return TestClient(TestServer(app)), metrics


def test_error_body_and_metrics_label_follow_the_route_entry():
    table = RouteTable([Route("POST", "/v1/a", refuse, ErrorStyle.TGI, "label_a"),
                        Route("POST", "/b", refuse, ErrorStyle.OPENAI, "label_b")])

    async def run():
        client, metrics = serve_table(table)
        async with client:
            a = await (await client.post("/v1/a")).json()
            b = await (await client.post("/b")).json()
        return a, b, metrics

    a, b, metrics = asyncio.run(run())
    assert a == {"error": "refused", "error_type": "invalid_request_error"}
    assert b == {"error": {"message": "refused", "type": "invalid_request_error", "param": "x", "code": 400},
                 "error_info": {"code": 400, "message": "refused"}}
    finished = metrics.registry.get_sample_value
    assert finished("pdserve_requests_finished_total", {"api": "label_a", "status": "400"}) == 1
    assert finished("pdserve_requests_finished_total", {"api": "label_b", "status": "400"}) == 1


def test_only_generation_routes_count_against_max_requests():
    table = RouteTable([Route("POST", "/gen", ok, ErrorStyle.TGI, "gen", generation=True),
                        Route("POST", "/other", ok, ErrorStyle.TGI, "other_api")])

    async def run():
        client, _ = serve_table(table, max_requests=0)
        async with client:
            return (await client.post("/gen")).status, (await client.post("/other")).status

    assert asyncio.run(run()) == (429, 200)
