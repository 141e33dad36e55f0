"""Server-sent events: `data: <json>\n\n` frames on an aiohttp stream response."""

from __future__ import annotations

import orjson
from aiohttp import web

# Non-string keys: logprob maps keyed by token id. orjson writes NaN and infinities as null, valid JSON.
JSON_OPTIONS = orjson.OPT_NON_STR_KEYS


def encode_event(payload: dict | str) -> bytes:
    body = payload.encode("utf-8") if isinstance(payload, str) else orjson.dumps(payload, option=JSON_OPTIONS)
    return b"data: " + body + b"\n\n"


async def open_stream(request: web.Request, content_type: str = "text/event-stream; charset=utf-8") -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": content_type, "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response
