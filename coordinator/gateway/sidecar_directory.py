"""Which sidecar fronts each decode worker: the endpoint the gateway is sent to when the picker chooses that worker.

  POST /v1/sidecars/announce  {"decode": host:port, "endpoint": host:port} -> 200 (again every third of the TTL)
  POST /v1/sidecars/withdraw  {"decode", "endpoint"} -> 200; 404 when not announced
  GET  /v1/sidecars           every sidecar known, with its decode worker and its age
On the management port, with the proof registration takes (http/management.py).
"""

from __future__ import annotations

import time
from typing import Annotated

from aiohttp import web
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from coordinator.addresses import check_host_port
from coordinator.apis.fields import parse_request, read_json
from coordinator.errors import ApiError
from coordinator.http.trust import require_proof
from coordinator.http.route_table import ErrorStyle, Route
from coordinator.state import STATE


class SidecarDirectory:
    """Decode worker → its sidecar's endpoint: announced ones until their TTL lapses, else the worker's host at
    `sidecar_port` (0: none)."""

    def __init__(self, ttl_s: float, sidecar_port: int = 0, clock=time.monotonic):
        self.ttl_s = ttl_s
        self.sidecar_port = sidecar_port
        self.clock = clock
        self._announced: dict[str, tuple[str, float]] = {}  # decode address -> (endpoint, when last announced)
        self._decode_of: dict[str, str] = {}  # endpoint -> decode address

    def announce(self, decode: str, endpoint: str) -> None:
        old = self._announced.get(decode)
        if old is not None and old[0] != endpoint:
            self._decode_of.pop(old[0], None)
        self._announced[decode] = (endpoint, self.clock())
        self._decode_of[endpoint] = decode

    def heard_from(self, endpoint: str) -> None:
        """The gateway reports that the sidecar at `endpoint` served a request: it is alive, as an announcement says."""
        decode = self._decode_of.get(endpoint)
        if decode is not None:
            self._announced[decode] = (endpoint, self.clock())

    def withdraw(self, decode: str, endpoint: str) -> bool:
        if self._announced.get(decode, ("",))[0] != endpoint:
            return False
        del self._announced[decode]
        self._decode_of.pop(endpoint, None)
        return True

    def endpoint_of(self, decode: str) -> str | None:
        """The sidecar the gateway reaches `decode` through; None: it has none, and is not picked."""
        announced = self._announced.get(decode)
        if announced is not None and self.clock() - announced[1] <= self.ttl_s:
            return announced[0]
        if self.sidecar_port:
            return f"{decode.rpartition(':')[0]}:{self.sidecar_port}"
        return None

    def decode_of(self, endpoint: str) -> str | None:
        """The decode worker behind the announced sidecar at `endpoint` (a served endpoint the gateway reports)."""
        return self._decode_of.get(endpoint)

    def describe(self) -> list[dict]:
        now = self.clock()
        return [{"decode": decode, "endpoint": endpoint, "age_s": round(now - at, 3),
                 "live": now - at <= self.ttl_s} for decode, (endpoint, at) in sorted(self._announced.items())]


class SidecarAnnouncement(BaseModel):
    """A sidecar naming the decode worker it fronts and where the gateway reaches it."""

    model_config = ConfigDict(extra="forbid")

    decode: Annotated[str, AfterValidator(check_host_port)] = Field(description="host:port of its decode worker")
    endpoint: Annotated[str, AfterValidator(check_host_port)] = Field(description="host:port the gateway reaches "
                                                                               "the sidecar at")


def _directory(request: web.Request) -> SidecarDirectory:
    picker = request.app[STATE].picker
    if picker is None:
        raise ApiError(409, "this coordinator runs no endpoint picker: set gateway_config.epp_port (or --epp-port) "
                            "to 0 or a port")
    return picker.sidecars


async def announce(request: web.Request) -> web.Response:
    require_proof(request)
    directory = _directory(request)
    body = parse_request(SidecarAnnouncement, await read_json(request))
    directory.announce(body.decode, body.endpoint)
    return web.json_response({"status": "ok", "ttl_s": directory.ttl_s})


async def withdraw(request: web.Request) -> web.Response:
    require_proof(request)
    body = parse_request(SidecarAnnouncement, await read_json(request))
    if not _directory(request).withdraw(body.decode, body.endpoint):
        raise ApiError(404, f"no sidecar at {body.endpoint} is announced for decode worker {body.decode}")
    return web.json_response({"status": "ok"})


async def list_sidecars(request: web.Request) -> web.Response:
    require_proof(request)
    return web.json_response({"sidecars": _directory(request).describe()})


SIDECAR_ROUTES = [
    Route("POST", "/v1/sidecars/announce", announce, ErrorStyle.OPENAI),
    Route("POST", "/v1/sidecars/withdraw", withdraw, ErrorStyle.OPENAI),
    Route("GET", "/v1/sidecars", list_sidecars, ErrorStyle.OPENAI),
]
