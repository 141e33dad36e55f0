"""A worker given several coordinators keeps its registration alive through whichever one answers."""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from worker.service.registration import CoordinatorRegistration


def a_closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def a_management_api(calls: list[str]) -> tuple[web.AppRunner, str]:
    async def handle(request: web.Request) -> web.Response:
        action = request.path.rsplit("/", 1)[-1]
        calls.append(action)
        return web.json_response({"heartbeat_interval_s": 0.05, "credential": "c"} if action == "register" else {})

    app = web.Application()
    app.router.add_post("/v1/instances/{action}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


async def test_heartbeats_move_to_the_next_coordinator_when_the_first_is_unreachable():
    calls: list[str] = []
    runner, url = await a_management_api(calls)
    down = f"http://127.0.0.1:{a_closed_port()}"
    registration = CoordinatorRegistration(f"{down}, {url}/", "decode", "127.0.0.1:5000", heartbeat_interval_s=0.05)
    await registration.start()
    try:
        await asyncio.wait_for(registration.registered.wait(), 5)
        while calls.count("heartbeat") < 2:
            await asyncio.sleep(0.02)
        assert registration.base_url == url and calls[0] == "register"
    finally:
        await registration.stop()
        await runner.cleanup()
    assert calls[-1] == "deregister"
