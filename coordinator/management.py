"""The management port: instance registration and listing, health, Prometheus metrics.

  POST /v1/instances/register    {"role", "address", "metrics_url"?} -> {"heartbeat_interval_s"}
  POST /v1/instances/heartbeat   {"role", "address"} -> 200, 404 when unknown (register again)
  POST /v1/instances/deregister  {"role", "address"} -> 200, 404 when unknown
  GET  /v1/instances             every instance with its state, load and outstanding work
  GET  /health, GET /metrics
"""

from __future__ import annotations

from typing import Annotated, Literal

from aiohttp import web
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from coordinator.apis import operations
from coordinator.apis.fields import parse_request, read_json
from coordinator.route_table import ErrorStyle, Route, RouteTable
from coordinator.config import check_host_port
from coordinator.errors import ApiError
from coordinator.state import STATE


class InstanceIdentity(BaseModel):
    """Which worker a management call is about."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["prefill", "decode"]
    address: Annotated[str, AfterValidator(check_host_port)] = Field(
        description="host:port of the worker's gRPC server")


class Registration(InstanceIdentity):
    metrics_url: str = ""


async def register(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = parse_request(Registration, await read_json(request))
    instance = state.registry.register(body.role, body.address, body.metrics_url)
    # Probe at once so its load is known before the first request is routed there.
    await state.health_monitor.check(instance)
    return web.json_response({"heartbeat_interval_s": state.heartbeat_interval_s, "instance": instance.describe()})


async def heartbeat(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = parse_request(InstanceIdentity, await read_json(request))
    if not state.registry.heartbeat(body.role, body.address):
        raise ApiError(404, f"{body.role} instance {body.address} is not registered; register again")
    return web.json_response({"status": "ok"})


async def deregister(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = parse_request(InstanceIdentity, await read_json(request))
    if not state.registry.deregister(body.role, body.address):
        raise ApiError(404, f"{body.role} instance {body.address} is not registered")
    state.forget_prefix(body.address)
    return web.json_response({"status": "ok"})


async def list_instances(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].registry.snapshot())


MANAGEMENT_ROUTES = RouteTable([
    Route("POST", "/v1/instances/register", register, ErrorStyle.OPENAI),
    Route("POST", "/v1/instances/heartbeat", heartbeat, ErrorStyle.OPENAI),
    Route("POST", "/v1/instances/deregister", deregister, ErrorStyle.OPENAI),
    Route("GET", "/v1/instances", list_instances, ErrorStyle.OPENAI),
    Route("GET", "/health", operations.health, ErrorStyle.TGI),
    Route("GET", "/metrics", operations.metrics, ErrorStyle.TGI),
])
