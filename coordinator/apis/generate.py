"""POST /generate: one path for two APIs, told apart by the body (`inputs`: TGI, `prompt`: vLLM)."""

from __future__ import annotations

from aiohttp import web

from coordinator.apis import tgi, vllm_native
from coordinator.apis.fields import read_json
from coordinator.apis.response_models import Reply, TgiResponse, VllmResponse
from coordinator.http.route_table import ErrorStyle, Route
from coordinator.errors import ApiError


async def generate(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    if not isinstance(body, dict) or ("inputs" in body) == ("prompt" in body):
        raise ApiError(400, "a /generate body needs exactly one of `inputs` (TGI) or `prompt` (vLLM)")
    if "inputs" in body:
        if body.get("stream"):
            raise ApiError(400, "stream: use /generate_stream (or POST /) to stream a TGI request", param="stream")
        return await tgi.serve_tgi(request, body, stream=False, native_shapes=False)
    return await vllm_native.serve_vllm(request, body)


ROUTES = [Route("POST", "/generate", generate, ErrorStyle.TGI, "generate", generation=True,
                body_model=tgi.TgiRequest | vllm_native.VllmGenerateRequest,
                reply=Reply(json=TgiResponse | VllmResponse, text=vllm_native.VllmFormatter.stream_content_type,
                            description="TGI's answer to a body with `inputs`, vLLM's to one with `prompt`. A vLLM "
                                        "stream (`stream: true`) is one {\"text\": [...]} object per token, each "
                                        "followed by a NUL byte."))]
