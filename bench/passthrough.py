"""The coordinator benchmark's floor: a mock OpenAI completions upstream and a minimal aiohttp pass-through proxy.

    .venv/bin/python bench/passthrough.py upstream [--decode-step-ms 1]
    .venv/bin/python bench/passthrough.py proxy --upstream http://127.0.0.1:PORT

`upstream` answers POST /v1/completions (stream) as the coordinator does in front of simulated workers: the same
`data: {...}` chunk per token, the first at once (prefill costs 0 ms), the others one per decode step, every stream
stepping on one shared clock as a decode worker's batch does; then the usage chunk and `data: [DONE]`. `proxy`
relays each request's body upstream over one shared aiohttp.ClientSession and the answer back chunk by chunk. Each
prints `passthrough <mode> ready: URL` once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import uuid
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.cli import run_event_loop  # noqa: E402

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


class StepClock:
    """Decode steps of `step_s`, shared by every stream: one starts when a stream waits and none is running."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self._step: asyncio.Future | None = None

    def next_step(self) -> asyncio.Future:
        if self._step is None:
            loop = asyncio.get_running_loop()
            self._step = loop.create_future()
            loop.call_later(self.step_s, self._end_step)
        return self._step

    def _end_step(self) -> None:
        step, self._step = self._step, None
        step.set_result(None)


def sse(event: dict | str) -> bytes:
    # Compact JSON, as the coordinator writes it, so each chunk is the same size as its own.
    data = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def upstream_app(step_s: float) -> web.Application:
    clock = StepClock(step_s)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        max_tokens = body["max_tokens"]
        chunk = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                 "model": body["model"]}
        # One token chunk's bytes around its text, built once: the upstream shares the workers' cores.
        choice = {"index": 0, "text": "TEXT", "logprobs": None, "finish_reason": None, "stop_reason": None}
        head, tail = sse(chunk | {"choices": [choice]}).split(b"TEXT")
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        for index in range(max_tokens):
            if index:
                await clock.next_step()
            await response.write(b"%s t%d%s" % (head, random.randrange(32000), tail))
        prompt_tokens = len(body["prompt"].split())
        final = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None}
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                 "total_tokens": prompt_tokens + max_tokens}
        await response.write(sse(chunk | {"choices": [final], "usage": usage, "error_info": None}))
        await response.write(sse("[DONE]"))
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


def proxy_app(upstream: str) -> web.Application:
    app = web.Application()

    async def open_session(app: web.Application):
        # No connection cap: a closed loop of 128 clients must not queue inside the proxy.
        async with aiohttp.ClientSession(upstream, connector=aiohttp.TCPConnector(limit=0)) as session:
            app["session"] = session
            yield

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with app["session"].post(request.path_qs, data=body,
                                       headers={"Content-Type": request.content_type}) as upstream_response:
            response = web.StreamResponse(status=upstream_response.status,
                                          headers={"Content-Type": upstream_response.headers["Content-Type"]})
            await response.prepare(request)
            async for chunk in upstream_response.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app.cleanup_ctx.append(open_session)
    app.router.add_post("/{path:.*}", relay)
    return app


async def serve(mode: str, app: web.Application, host: str) -> None:
    runner = web.AppRunner(app, access_log=None)  # as the coordinator runs its predict port
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    port = runner.addresses[0][1]
    print(f"passthrough {mode} ready: http://{host}:{port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("upstream", help="the mock completions server")
    p.add_argument("--decode-step-ms", type=float, default=1.0, help="time between two tokens of a stream")
    p = sub.add_parser("proxy", help="the pass-through proxy")
    p.add_argument("--upstream", required=True, help="the upstream's base URL")
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    app = upstream_app(args.decode_step_ms / 1000) if args.mode == "upstream" else proxy_app(args.upstream)
    run_event_loop(serve(args.mode, app, args.host))  # the coordinator's event loop, so only the relay differs


if __name__ == "__main__":
    main()
