"""GET /health, GET /health/live, GET /v1/models and GET /metrics."""

from __future__ import annotations

from aiohttp import web

from coordinator.apis.response_models import Health, Liveness, ModelList, Reply
from coordinator.gateway.sidecar import SIDECAR
from coordinator.http.route_table import ErrorStyle, Route
from coordinator.metrics import METRICS
from coordinator.state import STATE


def models_body(model_name: str, created: int, max_model_len: int, adapters: list[str] = ()) -> dict:
    """The model, then each LoRA adapter served beside it, with the model as its `parent` (as vLLM lists them)."""
    return {
        "object": "list",
        "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "pdserve",
                  "root": model_name, "max_model_len": max_model_len},
                 *({"id": name, "object": "model", "created": created, "owned_by": "pdserve", "root": name,
                    "parent": model_name, "max_model_len": max_model_len} for name in adapters)],
    }


def health_body(instances: dict[str, list[dict]], cluster: dict | None = None,
                needed: tuple[str, ...] = ("prefill", "decode")) -> tuple[int, dict]:
    """200 when an instance of each `needed` role is routable ("degraded" if some others are not),
    else 503; every instance is listed with its state. With etcd, `cluster` (ClusterNode.describe: role,
    etcd) is added, and a standby answers 503 so that a readiness probe sends it no traffic."""
    states = {role: {i["address"]: i["state"] for i in group} for role, group in instances.items()}
    serving = all("healthy" in states.get(role, {}).values() for role in needed)
    everyone = all(state == "healthy" for group in states.values() for state in group.values())
    status = "healthy" if serving and everyone else "degraded" if serving else "unhealthy"
    body = {"status": status, "instances": states}
    if cluster is not None:
        body.update(cluster)
        serving = serving and cluster["role"] != "standby"
    return (200 if serving else 503), body


async def models(request: web.Request) -> web.Response:
    """The served model and its LoRA adapters."""
    state = request.app[STATE]
    return web.json_response(models_body(state.model_name, state.started_at, state.limits.max_seq_len,
                                         list(state.loras.adapters)))


async def health(request: web.Request) -> web.Response:
    """Every known instance probed now; 200 while at least one prefill and one decode can serve (a sidecar: its
    decode worker, which prefills when no prefill worker is named)."""
    state = request.app[STATE]
    await state.health_monitor.check_all()
    status, body = health_body(state.registry.snapshot(),
                               state.cluster.describe() if state.cluster is not None else None,
                               ("decode",) if request.app.get(SIDECAR) is not None else ("prefill", "decode"))
    return web.json_response(body, status=status)


async def live(request: web.Request) -> web.Response:
    """200 while the process serves: a liveness probe, whatever the workers, etcd or this coordinator's role."""
    return web.json_response({"status": "alive"})


async def metrics(request: web.Request) -> web.Response:
    """Prometheus metrics of the coordinator, in the text exposition format."""
    return await request.app[METRICS].handle_metrics(request)


ROUTES = [
    Route("GET", "/v1/models", models, ErrorStyle.OPENAI, reply=Reply(json=ModelList)),
    Route("GET", "/health", health, ErrorStyle.TGI, reply=Reply(json=Health, statuses=(200, 503)), on_standby=True),
    Route("GET", "/health/live", live, ErrorStyle.TGI, reply=Reply(json=Liveness), on_standby=True),
    Route("GET", "/metrics", metrics, ErrorStyle.TGI, reply=Reply(text="text/plain"), on_standby=True),
]
