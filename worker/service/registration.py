"""A worker's membership in a coordinator: register, heartbeat, deregister.

The coordinator's management API (`http_config.manage_ip:manage_port`):
  POST /v1/instances/register    {"role", "address", "metrics_url"} -> {"heartbeat_interval_s", "credential"}
  POST /v1/instances/heartbeat   {"role", "address"}  -> 200, or 404 when the coordinator forgot us
  POST /v1/instances/deregister  {"role", "address"}  -> 200
Registering proves membership with the registration token (when one is set) or the TLS client
certificate; heartbeats and deregistration carry the credential the register answer issued.
A 404 on heartbeat (the coordinator restarted, or took us out) makes the worker register again.

Several coordinator URLs (`--coordinator A,B`) are tried in turn: when the one in use cannot be
reached, the next takes the heartbeats. With coordinators sharing etcd (`backup_config`) any of them
keeps the worker's registration alive, so an active coordinator's death costs no registration.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from security.secrets import SecretFile
from security.tls import LinkTls

CREDENTIAL_HEADER = "X-Pdserve-Credential"

logger = logging.getLogger(__name__)


class CoordinatorRegistration:
    """Keeps one worker registered with one coordinator until `stop`."""

    def __init__(self, coordinator_url: str, role: str, address: str, metrics_url: str = "",
                 heartbeat_interval_s: float = 2.0, tls: LinkTls | None = None, token: SecretFile | None = None):
        self.urls = [url.strip().rstrip("/") for url in coordinator_url.split(",") if url.strip()]
        self.base_url = self.urls[0]
        self.tls = tls
        self.token = token
        self._credential = ""
        self.identity = {"role": role, "address": address}
        self.metrics_url = metrics_url
        self.heartbeat_interval_s = heartbeat_interval_s
        self.registered = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Start registering and heartbeating in the background; never blocks on the coordinator."""
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop heartbeating and tell the coordinator to route nothing more here."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            try:
                await self._post("deregister", self.identity)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                logger.warning("deregister from %s failed: %s", self.base_url, exc)
            await self._session.close()

    async def _post(self, action: str, body: dict) -> tuple[int, dict]:
        headers = {CREDENTIAL_HEADER: self._credential} if self._credential else {}
        if action == "register" and self.token is not None:
            headers["Authorization"] = f"Bearer {self.token.value}"
        # The TLS context is taken per call, so a SIGHUP reload applies to the next one.
        ssl = self.tls.ssl_context() if self.tls is not None else None
        async with self._session.post(f"{self.base_url}/v1/instances/{action}", json=body, headers=headers,
                                      ssl=ssl if ssl is not None else True) as resp:
            data = await resp.json(content_type=None) if resp.content_length != 0 else {}
            return resp.status, data or {}

    def _fail_over(self) -> None:
        """Heartbeat through the next coordinator; one that never saw us (no shared etcd) answers 404, and we
        register there."""
        self.base_url = self.urls[(self.urls.index(self.base_url) + 1) % len(self.urls)]
        logger.warning("heartbeats go to coordinator %s now", self.base_url)

    async def _run(self) -> None:
        while True:
            try:
                if not self.registered.is_set():
                    status, data = await self._post("register", {**self.identity, "metrics_url": self.metrics_url})
                    if status == 200:
                        self._credential = str(data.get("credential", ""))
                        self.heartbeat_interval_s = float(data.get("heartbeat_interval_s", self.heartbeat_interval_s))
                        self.registered.set()
                        logger.info("registered with %s as %s %s", self.base_url, self.identity["role"],
                                    self.identity["address"])
                    else:
                        logger.warning("register with %s answered %s: %s", self.base_url, status, data)
                else:
                    status, _ = await self._post("heartbeat", self.identity)
                    if status in (403, 404):  # forgotten, or another worker registered this address since
                        self.registered.clear()
                        continue
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                logger.warning("coordinator %s unreachable: %s", self.base_url, exc)
                if len(self.urls) > 1:
                    self._fail_over()
            await asyncio.sleep(self.heartbeat_interval_s if self.registered.is_set() else 0.5)
