"""Server-sent events: `data: <json>\n\n` frames on an aiohttp stream response."""

from __future__ import annotations

import orjson
from aiohttp import web

# Non-string keys: logprob maps keyed by token id. orjson writes NaN and infinities as null, valid JSON.
JSON_OPTIONS = orjson.OPT_NON_STR_KEYS


def encode_event(payload: dict | str) -> bytes:
    """One `data:` event."""
    body = payload.encode("utf-8") if isinstance(payload, str) else orjson.dumps(payload, option=JSON_OPTIONS)
    return b"data: " + body + b"\n\n"


class ChunkTemplate:
    """A streamed chunk's bytes around its one varying JSON string, for the common shape of a token's chunk
    (a fifth of the cost of building its dict and encoding that)."""

    SLOT = "\x00pdserve-slot\x00"

    def __init__(self, frame: dict):
        """`frame` is the chunk with SLOT where the string goes."""
        self.head, self.tail = encode_event(frame).split(orjson.dumps(self.SLOT))

    def fill(self, text: str) -> bytes:
        return self.head + orjson.dumps(text) + self.tail


class HeadWithFirstChunkResponse(web.StreamResponse):
    """A streamed answer whose head leaves in one write with its first bytes, as aiohttp's web.Response sends its
    head with its body: a send and a client wake-up fewer per request."""

    _send_headers_immediately = False


async def open_stream(request: web.Request, content_type: str = "text/event-stream; charset=utf-8",
                      head_with_first_chunk: bool = False) -> web.StreamResponse:
    """Open a stream; with `head_with_first_chunk`, for a caller that writes its first bytes at once, its head
    waits for them."""
    kind = HeadWithFirstChunkResponse if head_with_first_chunk else web.StreamResponse
    response = kind(headers={"Content-Type": content_type, "Cache-Control": "no-cache"})
    if request.version == (1, 1):  # aiohttp chunks HTTP/1.1 only
        response.enable_chunked_encoding()  # what aiohttp picks for HTTP/1.1 anyway; said here so `chunked` tells
    await response.prepare(request)
    return response
