"""A worker's membership in a coordinator: register, heartbeat, deregister.

The coordinator's management API (`http_config.manage_ip:manage_port`):
  POST /v1/instances/register    {"role", "address", "metrics_url"} -> {"heartbeat_interval_s": float}
  POST /v1/instances/heartbeat   {"role", "address"}  -> 200, or 404 when the coordinator forgot us
  POST /v1/instances/deregister  {"role", "address"}  -> 200
A 404 on heartbeat (the coordinator restarted, or took us out) makes the worker register again.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

logger = logging.getLogger(__name__)


class CoordinatorRegistration:
    """Keeps one worker registered with one coordinator until `stop`."""

    def __init__(self, coordinator_url: str, role: str, address: str, metrics_url: str = "",
                 heartbeat_interval_s: float = 2.0):
        self.base_url = coordinator_url.rstrip("/")
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
        async with self._session.post(f"{self.base_url}/v1/instances/{action}", json=body) as resp:
            data = await resp.json(content_type=None) if resp.content_length != 0 else {}
            return resp.status, data or {}

    async def _run(self) -> None:
        while True:
            try:
                if not self.registered.is_set():
                    status, data = await self._post("register", {**self.identity, "metrics_url": self.metrics_url})
                    if status == 200:
                        self.heartbeat_interval_s = float(data.get("heartbeat_interval_s", self.heartbeat_interval_s))
                        self.registered.set()
                        logger.info("registered with %s as %s %s", self.base_url, self.identity["role"],
                                    self.identity["address"])
                    else:
                        logger.warning("register with %s answered %s: %s", self.base_url, status, data)
                else:
                    status, _ = await self._post("heartbeat", self.identity)
                    if status == 404:
                        self.registered.clear()
                        continue
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                logger.warning("coordinator %s unreachable: %s", self.base_url, exc)
            await asyncio.sleep(self.heartbeat_interval_s if self.registered.is_set() else 0.5)
