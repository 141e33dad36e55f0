"""GET /health, GET /v1/models and GET /metrics."""

from __future__ import annotations

from aiohttp import web

from coordinator.apis.response_models import Health, ModelList, Reply
from coordinator.route_table import ErrorStyle, Route
from coordinator.metrics import METRICS
from coordinator.state import STATE


def models_body(model_name: str, created: int, max_model_len: int) -> dict:
    return {
        "object": "list",
        "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "pdserve",
                  "root": model_name, "max_model_len": max_model_len}],
    }


def health_body(instances: dict[str, list[dict]]) -> tuple[int, dict]:
    """200 when a prefill and a decode instance are routable ("degraded" if some others are not),
    else 503; every instance is listed with its state."""
    states = {role: {i["address"]: i["state"] for i in group} for role, group in instances.items()}
    serving = all("healthy" in group.values() for group in states.values())
    everyone = all(state == "healthy" for group in states.values() for state in group.values())
    status = "healthy" if serving and everyone else "degraded" if serving else "unhealthy"
    return (200 if serving else 503), {"status": status, "instances": states}


async def models(request: web.Request) -> web.Response:
    """The served model."""
    state = request.app[STATE]
    return web.json_response(models_body(state.model_name, state.started_at, state.limits.max_seq_len))


async def health(request: web.Request) -> web.Response:
    """Every known instance probed now; 200 while at least one prefill and one decode can serve."""
    state = request.app[STATE]
    await state.health_monitor.check_all()
    status, body = health_body(state.registry.snapshot())
    return web.json_response(body, status=status)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus metrics of the coordinator, in the text exposition format."""
    return await request.app[METRICS].handle_metrics(request)


ROUTES = [
    Route("GET", "/v1/models", models, ErrorStyle.OPENAI, reply=Reply(json=ModelList)),
    Route("GET", "/health", health, ErrorStyle.TGI, reply=Reply(json=Health, statuses=(200, 503))),
    Route("GET", "/metrics", metrics, ErrorStyle.TGI, reply=Reply(text="text/plain")),
]
