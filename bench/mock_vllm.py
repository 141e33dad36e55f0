"""Mock vLLM instances for measuring routers alone: vLLM's OpenAI completions protocol and NIXL handshake, no model.

    .venv/bin/python bench/mock_vllm.py [--instances 2] [--decode-step-ms 5]

Each instance answers as a vLLM instance started with a NixlConnector answers its router (the bytes a router reads
are vLLM's: the same chunk fields, chunked transfer encoding, one server-sent event per token):
- POST /v1/completions with `kv_transfer_params.do_remote_decode` (a prefill): one token, not streamed, with the
  `kv_transfer_params` a decode instance is to be given;
- POST /v1/completions streamed: one chunk per token, the first with the prompt's ids when `return_token_ids`
  asks for them, every stream stepping on one shared clock (bench/passthrough.py's), then the usage chunk when
  `stream_options.include_usage` asks for it, and `data: [DONE]`;
- GET /health, GET /metrics (vLLM's gauges among ~80 KB of histogram lines, as a real page), GET /v1/models.
Prints `mock vllm ready: URL URL ...` once every instance listens.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path

import orjson
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.passthrough import SSE_HEADERS, StepClock  # noqa: E402
from launcher.cli import run_event_loop  # noqa: E402

METRICS = ("# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
           "# TYPE vllm:num_requests_running gauge\n"
           'vllm:num_requests_running{engine="0",model_name="mock"} %d\n'
           'vllm:num_requests_waiting{engine="0",model_name="mock"} 0.0\n'
           'vllm:kv_cache_usage_perc{engine="0",model_name="mock"} 0.01\n'
           'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="4096"} 1.0\n'
           + "".join(f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{i}",model_name="mock"}} 0.0\n'
                     for i in range(1200)))


def event(chunk: dict) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def instance_app(clock: StepClock, name: str) -> web.Application:
    running = 0

    async def completions(request: web.Request) -> web.StreamResponse:
        nonlocal running
        body = orjson.loads(await request.read())
        prompt = body["prompt"]
        prompt_ids = prompt if isinstance(prompt, list) else [hash(w) % 32000 for w in prompt.split()]
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": body.get("model", name)}
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            return web.Response(body=orjson.dumps(head | {
                "choices": [{"index": 0, "text": " t", "token_ids": [7], "finish_reason": "length",
                             "stop_reason": None, "logprobs": None}],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": 1},
                "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                       "remote_engine_id": "mock", "remote_block_ids": [1, 2],
                                       "remote_host": "127.0.0.1", "remote_port": 5600}}),
                content_type="application/json")
        max_tokens = body["max_tokens"]
        with_ids = body.get("return_token_ids", False)
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        running += 1
        try:
            for index in range(max_tokens):
                if index:
                    await clock.next_step()
                last = index == max_tokens - 1
                choice = {"index": 0, "text": f" t{index}", "logprobs": None,
                          "finish_reason": "length" if last else None, "stop_reason": None}
                if with_ids:
                    choice["token_ids"] = [100 + index % 1000]
                    choice["prompt_token_ids"] = prompt_ids if index == 0 else None
                await response.write(event(head | {"choices": [choice], "usage": None}))
            if (body.get("stream_options") or {}).get("include_usage"):
                await response.write(event(head | {"choices": [], "usage": {
                    "prompt_tokens": len(prompt_ids), "completion_tokens": max_tokens,
                    "total_tokens": len(prompt_ids) + max_tokens}}))
            await response.write(b"data: [DONE]\n\n")
        finally:
            running -= 1
        await response.write_eof()
        return response

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=METRICS % running)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": name, "object": "model"}]})

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions), web.get("/health", health),
                    web.get("/metrics", metrics), web.get("/v1/models", models)])
    return app


async def serve(args) -> None:
    clock = StepClock(args.decode_step_ms / 1000)
    urls = []
    for _ in range(args.instances):
        runner = web.AppRunner(instance_app(clock, args.name), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
    print("mock vllm ready:", " ".join(urls), flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--decode-step-ms", type=float, default=5.0)
    parser.add_argument("--name", default="mock", help="the model name the instances serve")
    run_event_loop(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
