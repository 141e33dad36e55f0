"""Server-sent events: `data: <json>\n\n` frames on an aiohttp stream response."""

from __future__ import annotations

import json

from aiohttp import web


def encode_event(payload: dict | str) -> bytes:
    body = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {body}\n\n".encode("utf-8")


async def open_stream(request: web.Request, content_type: str = "text/event-stream; charset=utf-8") -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": content_type, "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response
