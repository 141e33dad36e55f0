"""The management port: instance registration and listing, health, Prometheus metrics.

  POST /v1/instances/register    {"role", "address", "metrics_url"?} -> {"heartbeat_interval_s", "credential"}
  POST /v1/instances/heartbeat   {"role", "address"} -> 200, 404 when unknown (register again)
  POST /v1/instances/deregister  {"role", "address"} -> 200, 404 when unknown
  GET  /v1/instances             every instance with its state, load and outstanding work
  POST /v1/instances/switch_role {"address", "role", "drain_timeout_s"?} -> 202 once the worker left the old role
  POST /v1/instances/drain       {"address", "role"?, "drain_timeout_s"?} -> out of routing, requests end or move
  POST /v1/instances/resume      {"address", "role"?} -> back into routing once a health check passes
  GET  /v1/cluster/formats       each wire format's active version, the finalize, every process's release
  POST /v1/cluster/finalize      this release becomes the cluster's floor -> 200, 409 while a process is older
  GET  /v1/plan                  the online planner's last decision (planner_config), or {"enabled": false}
  POST /v1/load_lora_adapter     {"lora_name", "lora_path"} -> served under that name (`model`, `adapter_id`)
  POST /v1/unload_lora_adapter   {"lora_name"} -> no longer served (requests holding it run to their end)
  GET  /health, GET /health/live, GET /metrics

Only real workers join: with mutual TLS on this port the handshake is the proof; otherwise, when
auth_config.registration_token_file is set, register and the instance API need
`Authorization: Bearer <token>` (as do the LoRA adapter calls). Registration issues a per-instance credential that the worker's
heartbeats and its deregistration carry in `X-Pdserve-Credential`, so a worker speaks only for itself.
Only the credential's SHA-256 is kept (and, with etcd, shared): any coordinator of the cluster checks a
worker's heartbeats against it, whichever coordinator issued it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import secrets
from typing import Annotated, Literal

from aiohttp import web
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from coordinator.apis import operations
from coordinator.apis.fields import parse_request, read_json
from coordinator.http.route_table import ErrorStyle, Route, RouteTable
from coordinator.config import check_host_port
from coordinator.errors import ApiError
from coordinator.requests.failures import WorkerCallError
from coordinator.state import STATE
from coordinator.workers.instance_drain import DrainRequest, ResumeRequest, drain_instance, resume_instance
from coordinator.gateway.sidecar_directory import SIDECAR_ROUTES
from coordinator.http.trust import TRUST, require_proof

CREDENTIAL_HEADER = "X-Pdserve-Credential"


class InstanceIdentity(BaseModel):
    """Which worker a management call is about."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["prefill", "decode", "encode"]
    address: Annotated[str, AfterValidator(check_host_port)] = Field(
        description="host:port of the worker's gRPC server")


class Registration(InstanceIdentity):
    metrics_url: str = ""


def credential_digest(credential: bytes) -> str:
    """What is kept of a credential: its SHA-256, hex."""
    return hashlib.sha256(credential).hexdigest()


def _is_own(request: web.Request, instance) -> bool:
    presented = request.headers.get(CREDENTIAL_HEADER, "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(credential_digest(presented), instance.credential)


def require_own_credential(request: web.Request, body: InstanceIdentity) -> None:
    """404 for an unknown instance, 403 when the caller is not the worker that registered it."""
    instance = request.app[STATE].registry.get(body.role, body.address)
    if instance is None or not instance.registered:
        raise ApiError(404, f"{body.role} instance {body.address} is not registered; register again")
    if not _is_own(request, instance):
        raise ApiError(403, f"{CREDENTIAL_HEADER} does not match the credential issued when {body.role} instance "
                       f"{body.address} registered: a worker may heartbeat and deregister only itself")


def refuse_taking_over(request: web.Request, body: InstanceIdentity) -> None:
    """409 for registering an address whose worker is registered and heartbeating, unless it is that worker:
    another member must not take over its slot (a restarted worker registers again once its heartbeats lapse)."""
    state = request.app[STATE]
    instance = state.registry.get(body.role, body.address)
    if instance is None or not instance.registered or _is_own(request, instance):
        return
    # On etcd, whether it heartbeats is the cluster's view (during an outage: what was last read, and this
    # coordinator's own heartbeats), so a worker restarted on its address can register again once they lapse.
    heartbeating = (state.cluster.heartbeating(body.role, body.address) if state.cluster is not None
                    else state.registry.clock() - instance.last_heartbeat < state.registry.heartbeat_timeout_s)
    if heartbeating:
        raise ApiError(409, f"{body.role} instance {body.address} is registered and heartbeating; only it may "
                       f"register again (with {CREDENTIAL_HEADER}), or another worker once its heartbeats lapse",
                       error_type="conflict_error")


async def register(request: web.Request) -> web.Response:
    require_proof(request)
    state = request.app[STATE]
    if state.engine != "pdserve":
        raise ApiError(409, f"this coordinator drives {state.engine} instances (instances in its config): a pdserve "
                            "worker cannot join them, a KV transfer runs between two instances of one engine")
    body = parse_request(Registration, await read_json(request))
    refuse_taking_over(request, body)
    instance = state.registry.register(body.role, body.address, body.metrics_url)
    credential = secrets.token_urlsafe(32)
    instance.credential = credential_digest(credential.encode())
    if state.cluster is not None:
        state.cluster.registered(instance)
    # Probe at once so its load and its release are known before the first request is routed there.
    await state.health_monitor.check(instance)
    refusal = state.formats.may_join(instance.versions) if state.formats is not None else None
    if refusal is not None:
        state.registry.deregister(body.role, body.address)
        if state.cluster is not None:
            state.cluster.deregistered(body.role, body.address)
        raise ApiError(409, refusal, error_type="conflict_error")
    return web.json_response({"heartbeat_interval_s": state.heartbeat_interval_s, "instance": instance.describe(),
                              "credential": credential})


async def heartbeat(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = parse_request(InstanceIdentity, await read_json(request))
    require_own_credential(request, body)
    state.registry.heartbeat(body.role, body.address)
    if state.cluster is not None:
        state.cluster.heartbeat(state.registry.get(body.role, body.address))
    return web.json_response({"status": "ok"})


async def deregister(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = parse_request(InstanceIdentity, await read_json(request))
    require_own_credential(request, body)
    state.registry.deregister(body.role, body.address)
    if state.cluster is not None:
        state.cluster.deregistered(body.role, body.address)
    return web.json_response({"status": "ok"})


class LoraLoad(BaseModel):
    """vLLM's body for POST /v1/load_lora_adapter."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str


class LoraUnload(BaseModel):
    """vLLM's body for POST /v1/unload_lora_adapter (`lora_int_id` is vLLM's and not needed)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None


async def load_lora_adapter(request: web.Request) -> web.Response:
    """Serve an adapter from now on: pdserve workers load it on demand; vLLM instances are each told to load it
    first (all or none)."""
    require_proof(request)
    state = request.app[STATE]
    body = parse_request(LoraLoad, await read_json(request))
    try:
        state.loras.add(await asyncio.to_thread(state.loras.check, body.lora_name, body.lora_path))
    except ValueError as exc:
        raise ApiError(400, str(exc), param="lora_path") from None
    if state.engine == "vllm":
        try:
            await state.client.update_adapters("/v1/load_lora_adapter", body.model_dump(include={"lora_name",
                                                                                               "lora_path"}))
        except WorkerCallError as exc:
            state.loras.unload(body.lora_name)
            with contextlib.suppress(WorkerCallError):  # those that loaded it unload it again
                await state.client.update_adapters("/v1/unload_lora_adapter", {"lora_name": body.lora_name})
            raise ApiError(400, f"a vLLM instance refused the adapter: {exc}", param="lora_path") from None
    return web.json_response({"status": "ok", "lora_name": body.lora_name})


async def unload_lora_adapter(request: web.Request) -> web.Response:
    require_proof(request)
    state = request.app[STATE]
    body = parse_request(LoraUnload, await read_json(request))
    try:
        state.loras.unload(body.lora_name)
    except KeyError:
        raise ApiError(404, f"lora_name={body.lora_name!r}: no such LoRA adapter; served: "
                            f"{list(state.loras.adapters)}", param="lora_name") from None
    if state.engine == "vllm":
        try:
            await state.client.update_adapters("/v1/unload_lora_adapter", {"lora_name": body.lora_name})
        except WorkerCallError as exc:  # no request selects it any more; an instance keeps it loaded
            raise ApiError(502, f"the adapter is no longer served, but a vLLM instance did not unload it: {exc}",
                           param="lora_name") from None
    return web.json_response({"status": "ok", "lora_name": body.lora_name})


class RoleSwitchBody(BaseModel):
    """POST /v1/instances/switch_role: a registered worker to serve the other role, in place."""

    model_config = ConfigDict(extra="forbid")

    address: Annotated[str, AfterValidator(check_host_port)] = Field(
        description="host:port of the worker's gRPC server")
    role: Literal["prefill", "decode"] = Field(description="the role it is to serve from now on")
    drain_timeout_s: float = Field(30.0, ge=0, le=3600, allow_inf_nan=False,
                                   description="longest wait for its requests in flight; decode streams left then "
                                               "migrate")


async def switch_role(request: web.Request) -> web.Response:
    """Take the worker out of its old role's routing and have it switch (worker/service/role_switch.py)."""
    require_proof(request)
    state = request.app[STATE]
    body = parse_request(RoleSwitchBody, await read_json(request))
    if state.engine != "pdserve":
        raise ApiError(409, f"{state.engine} instances cannot switch roles in place (a vLLM engine's kv_role is fixed "
                            "when it starts): start an instance of the other role instead", param="role")
    old = "decode" if body.role == "prefill" else "prefill"
    instance = state.registry.get(old, body.address)
    if instance is None:
        already = state.registry.get(body.role, body.address) is not None
        raise ApiError(409 if already else 404, f"{body.address} is a {body.role} instance already" if already else
                       f"no {old} instance is registered at {body.address}", param="address")
    if not instance.registered:
        raise ApiError(409, f"{old} instance {body.address} comes from the config file: only registered workers switch "
                            "(they register again in the new role)", param="address")
    if len(state.registry.instances(old)) <= 1:
        raise ApiError(409, f"{body.address} is the last {old} instance: a cluster keeps at least one of each role",
                       param="address")
    try:
        in_flight = await state.client.switch_role(body.address, body.role, body.drain_timeout_s)
    except WorkerCallError as exc:
        raise ApiError(502, f"the worker did not switch: {exc}", param="address") from None
    # The worker deregistered before answering; this covers a deregistration sent to another coordinator.
    state.registry.deregister(old, body.address)
    if state.cluster is not None:
        state.cluster.deregistered(old, body.address)
    return web.json_response({"status": "switching", "address": body.address, "from": old, "to": body.role,
                              "in_flight": in_flight}, status=202)


async def plan(request: web.Request) -> web.Response:
    require_proof(request)
    planner = request.app[STATE].planner
    return web.json_response(planner.describe() if planner is not None else {"enabled": False})


async def drain(request: web.Request) -> web.Response:
    """POST /v1/instances/drain: out of routing, its requests finish within the budget, then its streams move."""
    require_proof(request)
    state = request.app[STATE]
    body = parse_request(DrainRequest, await read_json(request))
    # vLLM streams are not moved: a move of a vLLM stream under way cut its text short in testing (to be fixed);
    # they run to their end on the held instance, or migrate when it stops.
    movers = state.pipeline.attempts.rebalancer if state.engine == "pdserve" else None
    return web.json_response(await drain_instance(state.registry, movers, body))


async def resume(request: web.Request) -> web.Response:
    """POST /v1/instances/resume: a drained instance back into routing once a health check passes (one runs now)."""
    require_proof(request)
    state = request.app[STATE]
    answer = resume_instance(state.registry, parse_request(ResumeRequest, await read_json(request)))
    await state.health_monitor.check(state.registry.get(answer["role"], answer["address"]))
    return web.json_response({**answer, "state": state.registry.get(answer["role"], answer["address"]).state.value})


async def cluster_formats(request: web.Request) -> web.Response:
    """GET /v1/cluster/formats: each wire format's active version, the finalize, every process's release."""
    return web.json_response(request.app[STATE].formats.describe())


async def finalize(request: web.Request) -> web.Response:
    """POST /v1/cluster/finalize: this release becomes the cluster's floor (409 while a process runs an older one)."""
    require_proof(request)
    state = request.app[STATE]
    release = await state.cluster.finalize() if state.cluster is not None else state.formats.finalize()
    return web.json_response({"finalized": release, **state.formats.describe()})


async def list_instances(request: web.Request) -> web.Response:
    require_proof(request)
    return web.json_response(request.app[STATE].instances())


MANAGEMENT_ROUTES = RouteTable([
    Route("POST", "/v1/instances/register", register, ErrorStyle.OPENAI),
    Route("POST", "/v1/instances/heartbeat", heartbeat, ErrorStyle.OPENAI),
    Route("POST", "/v1/instances/deregister", deregister, ErrorStyle.OPENAI),
    Route("GET", "/v1/instances", list_instances, ErrorStyle.OPENAI),
    Route("POST", "/v1/instances/drain", drain, ErrorStyle.OPENAI),
    Route("POST", "/v1/instances/resume", resume, ErrorStyle.OPENAI),
    Route("GET", "/v1/cluster/formats", cluster_formats, ErrorStyle.OPENAI),
    Route("POST", "/v1/cluster/finalize", finalize, ErrorStyle.OPENAI),
    Route("POST", "/v1/instances/switch_role", switch_role, ErrorStyle.OPENAI),
    Route("GET", "/v1/plan", plan, ErrorStyle.OPENAI),
    Route("POST", "/v1/load_lora_adapter", load_lora_adapter, ErrorStyle.OPENAI),
    Route("POST", "/v1/unload_lora_adapter", unload_lora_adapter, ErrorStyle.OPENAI),
    Route("GET", "/health", operations.health, ErrorStyle.TGI),
    Route("GET", "/health/live", operations.live, ErrorStyle.TGI),
    Route("GET", "/metrics", operations.metrics, ErrorStyle.TGI),
    *SIDECAR_ROUTES,
])
