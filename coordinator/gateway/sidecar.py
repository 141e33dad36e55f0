"""A decode pod's sidecar: the coordinator's client APIs for one decode worker, behind a Gateway API inference gateway.

A request's life through a sidecar:
  1. The gateway's endpoint picker chose this pod and named the prefill worker in x-prefiller-host-port (or none:
     the decode worker prefills itself); Envoy sent the request here.
  2. SidecarAdmission reads that header, the objective (priority) and x-pdserve-speculative; tenants' limits were
     applied by the picker, not again here.
  3. The pipeline runs as a coordinator's (router.py `prefill_at`): retries of a failed prefill on the decode
     worker itself; a lost decode worker is a clear error, since a pod-local sidecar has no other.
The sidecar announces itself (decode worker → its endpoint) to the picker every third of gateway_config.sidecar_ttl_s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import aiohttp
from aiohttp import web

from coordinator.gateway.endpoint_pick import KV_PULL_HEADER, PREFILLER_HEADER
from coordinator.gateway.settings import SidecarConfig
from coordinator.config import ConfigError, CoordinatorConfig, check_host_port, parse_config
from coordinator.errors import ApiError
from coordinator.requests.request import GenerationRequest, NamedPrefill
from coordinator.tenancy.admission import Admission
from security.secrets import SecretFile
from security.tls import LinkTls

logger = logging.getLogger(__name__)


class SidecarAdmission:
    """A sidecar's requests: priority and drafting from the headers, as a coordinator reads them, and the prefill
    worker the gateway named."""

    def __init__(self, admission: Admission):
        self.admission = admission

    def admit(self, http_request: web.Request, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        headers = http_request.headers
        priority = self.admission.header_priority(headers)
        no_drafts = self.admission.header_no_drafts(headers)
        named = named_prefill(headers)
        return [dataclasses.replace(r, priority=r.priority or priority, no_drafts=no_drafts, prefill_at=named)
                for r in requests]


def named_prefill(headers) -> NamedPrefill:
    """Where the picker placed the prefill (x-prefiller-host-port, x-pdserve-kv-pull); 400 naming a bad header."""
    address = headers.get(PREFILLER_HEADER, "").strip()
    if address:
        _host_port(PREFILLER_HEADER, address)
    pull = headers.get(KV_PULL_HEADER, "").strip()
    if not pull or not address:
        return NamedPrefill(address)
    pull_from, _, tokens = pull.partition(" ")
    _host_port(KV_PULL_HEADER, pull_from)
    if not tokens.strip().isdigit():
        raise ApiError(400, f"header {KV_PULL_HEADER} must be host:port and a whole number of tokens, got {pull!r}",
                       param=KV_PULL_HEADER)
    return NamedPrefill(address, pull_from, int(tokens))


def _host_port(header: str, value: str) -> None:
    try:
        check_host_port(value)
    except ValueError as exc:
        raise ApiError(400, f"header {header} {exc}", param=header) from None


class SidecarAnnouncer:
    """Tells the endpoint picker which decode worker this sidecar fronts, until stopped (then withdraws)."""

    def __init__(self, config: SidecarConfig, ttl_s: float, tls: LinkTls | None = None,
                 token: SecretFile | None = None):
        self.url = config.announce_to
        self.body = {"decode": config.decode, "endpoint": config.advertise}
        self.interval_s = ttl_s / 3
        self.tls = tls
        self.token = token
        self.announced = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            try:
                await self._post("withdraw")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                logger.warning("withdrawing this sidecar from %s failed: %s", self.url, exc)
            await self._session.close()

    async def _post(self, action: str) -> int:
        headers = {"Authorization": f"Bearer {self.token.value}"} if self.token is not None else {}
        ssl = self.tls.ssl_context() if self.tls is not None else None
        async with self._session.post(f"{self.url}/v1/sidecars/{action}", json=self.body, headers=headers,
                                      ssl=ssl if ssl is not None else True) as resp:
            if resp.status != 200:
                logger.warning("%s this sidecar to %s answered %s: %s", action, self.url, resp.status,
                               (await resp.text())[:200])
            return resp.status

    async def _run(self) -> None:
        while True:
            heard = False
            try:
                heard = await self._post("announce") == 200
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                logger.warning("endpoint picker %s unreachable: %s", self.url, exc)
            if heard:
                self.announced.set()
            # A missed announcement is sent again soon: a busy sidecar must not lapse from the picker's directory.
            await asyncio.sleep(self.interval_s if heard else 0.5)


SIDECAR = web.AppKey("sidecar", SidecarAdmission)


def sidecar_settings(config: CoordinatorConfig, decode: str, port: int, advertise: str = "",
                     announce_to: str = "") -> CoordinatorConfig:
    """A cluster's config made a sidecar's: client APIs on `port` for the decode worker at `decode` (a vLLM instance
    must be listed in `instances`), prefill where the gateway names it; no picker, planner, etcd or KV index here,
    and no prefill instances listed."""
    listed = [i for i in config.instances.decode if i.address == decode]
    if config.instances.engine == "vllm" and not listed:
        raise ConfigError(f"--decode {decode}: a vLLM decode instance must be listed in instances.decode (its url); "
                          f"listed: {[i.address for i in config.instances.decode]}")
    if not port and not advertise:
        raise ConfigError("--port 0: a sidecar announces where it listens before it could tell which port it bound; "
                          "give a port, or --advertise HOST:PORT")
    data = config.model_dump(by_alias=True)
    data["instances"]["decode"] = [listed[0].model_dump()] if listed else [{"address": decode}]
    data["instances"]["prefill"] = []  # each request names its own (added on first sight), as in a decode pod
    data["http_config"]["predict_port"] = port
    data["http_config"]["manage_port"] = 0
    data["digs_scheduler_config"]["algorithm_type"] = "round_robin"
    data["digs_scheduler_config"]["local_prefill_max_tokens"] = 0
    data["exception_config"]["max_migrations"] = 0  # no other decode worker here
    data["backup_config"]["etcd_endpoints"] = []
    data["planner_config"]["enabled"] = False
    data["rebalance_config"]["enabled"] = False
    data["gateway_config"]["epp_port"] = -1
    data["sidecar_config"] = {"decode": decode, "advertise": advertise or f"{config.http_config.predict_ip}:{port}",
                              "announce_to": announce_to}
    sidecar = parse_config(data, "the sidecar's config")
    # Paths were resolved against the cluster's config file already.
    sidecar.tls_config, sidecar.auth_config = config.tls_config, config.auth_config
    sidecar.planner_config = config.planner_config.model_copy(update={"enabled": False})
    return sidecar
