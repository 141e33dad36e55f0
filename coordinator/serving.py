"""Run one generation through the pipeline and write it back as JSON or as a stream.

Adapters supply a formatter; this module only moves events, so every API streams, ends and
reports late errors the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import orjson
from aiohttp import web

from coordinator.errors import ApiError
from coordinator.metrics import METRICS, api_label
from coordinator.pipeline import RequestPipeline
from coordinator.request import Finished, GenerationRequest, TokenDelta
from coordinator.sse import JSON_OPTIONS, encode_event, open_stream

logger = logging.getLogger(__name__)


@dataclass
class Transcript:
    """What has been generated so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    deltas: list[TokenDelta] = field(default_factory=list)
    finished: Finished | None = None


class ResponseFormatter(Protocol):
    """Per-API wire format of a generation."""

    done_marker: str | None
    stream_content_type: str

    def encode(self, frame: dict | str) -> bytes: ...

    def token_frames(self, delta: TokenDelta, transcript: Transcript) -> list[dict]: ...

    def final_frames(self, finished: Finished, transcript: Transcript) -> list[dict]: ...

    def error_frames(self, error: ApiError, transcript: Transcript) -> list[dict]: ...

    def response(self, transcript: Transcript) -> dict: ...


async def serve_generation(
    http_request: web.Request,
    pipeline: RequestPipeline,
    request: GenerationRequest,
    formatter: ResponseFormatter,
    stream: bool,
) -> web.StreamResponse:
    transcript = Transcript()
    events = pipeline.generate(request)
    if not stream:
        try:
            async for event in events:
                record(transcript, event)
        finally:
            await events.aclose()
        return web.json_response(formatter.response(transcript), dumps=json_dumps)

    response: web.StreamResponse | None = None
    tail: list[dict | str] = []
    try:
        async for event in events:
            if response is None:
                # Opened on the first event, so a failure before it is a plain HTTP error.
                response = await open_stream(http_request, formatter.stream_content_type)
            record(transcript, event)
            if isinstance(event, TokenDelta):
                await response.write(b"".join(map(formatter.encode, formatter.token_frames(event, transcript))))
            else:  # the end: written below with the stream's last bytes
                tail = formatter.final_frames(event, transcript)
    except ApiError as error:
        if response is None:
            raise
        logger.warning("request %s failed mid-stream: %s", request.request_id, error.message)
        http_request.app[METRICS].fail(api_label(http_request), error.status)
        tail = formatter.error_frames(error, transcript)
    finally:
        await events.aclose()
    if formatter.done_marker is not None:
        tail.append(formatter.done_marker)
    # The last chunk, usage, the done marker and the end of the body leave in one write.
    await response.write_eof(b"".join(map(formatter.encode, tail)))
    return response


class SseFormatter:
    """Default framing: server-sent `data:` events."""

    done_marker: str | None = None
    stream_content_type = "text/event-stream; charset=utf-8"

    def encode(self, frame: dict | str) -> bytes:
        return encode_event(frame)


def record(transcript: Transcript, event) -> None:
    """Add one event to a transcript."""
    if isinstance(event, TokenDelta):
        transcript.text += event.text
        transcript.token_ids.append(event.token_id)
        transcript.deltas.append(event)
    else:
        transcript.finished = event


def json_dumps(obj) -> str:
    return orjson.dumps(obj, option=JSON_OPTIONS).decode("utf-8")
