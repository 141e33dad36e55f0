"""Run one generation through the pipeline and write it back as JSON or as a stream.

Adapters supply a formatter; this module only moves events, so every API streams, ends and
reports late errors the same way.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Protocol

import orjson
from aiohttp import web

from coordinator.errors import ApiError
from coordinator.metrics import METRICS, api_label
from coordinator.requests.pipeline import RequestPipeline
from coordinator.requests.request import Failed, Finished, GenerationEvent, GenerationRequest, TokenDelta
from coordinator.http.sse import JSON_OPTIONS, encode_event, open_stream
from coordinator.gateway.sidecar import SIDECAR
from coordinator.tenancy.admission import ADMISSION, close_tickets

logger = logging.getLogger(__name__)


class Transcript:
    """What has been generated so far; the text is kept as pieces and joined when read."""

    def __init__(self, text: str = ""):
        self.pieces: list[str] = [text] if text else []
        self.length = len(text)  # characters of text so far
        self.token_ids: list[int] = []
        self.deltas: list[TokenDelta] = []
        self.finished: Finished | None = None

    @property
    def text(self) -> str:
        pieces = self.pieces
        if len(pieces) > 1:
            pieces[:] = ["".join(pieces)]
        return pieces[0] if pieces else ""

    @text.setter
    def text(self, value: str) -> None:
        self.pieces = [value] if value else []
        self.length = len(value)

    def add(self, delta: TokenDelta) -> None:
        self.pieces.append(delta.text)
        self.length += len(delta.text)
        self.token_ids.append(delta.token_id)
        self.deltas.append(delta)


class ResponseFormatter(Protocol):
    """Per-API wire format of a generation."""

    done_marker: str | None
    stream_content_type: str

    def encode(self, frame: dict | str) -> bytes: ...

    def token_bytes(self, delta: TokenDelta, transcript: Transcript) -> bytes | None:
        """The token's stream bytes when a cheaper path than `token_frames` gives them (the same bytes)."""

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
    (request,) = admitted(http_request, [request])
    try:
        if not stream:
            return web.json_response(formatter.response(await collect(pipeline, request)), dumps=json_dumps)
        writer = TokenWriter(formatter, Transcript())
        return await stream_events(http_request, pipeline.generate(request, writer), [writer], request.request_id)
    finally:
        close_tickets([request])


async def collect(pipeline: RequestPipeline, request: GenerationRequest) -> Transcript:
    """A whole generation's events, recorded in one transcript."""
    transcript = Transcript()
    events = pipeline.generate(request)
    try:
        async for event in events:
            record(transcript, event)
    finally:
        await events.aclose()
    return transcript


def admitted(http_request: web.Request, requests: list[GenerationRequest]) -> list[GenerationRequest]:
    """One client request's generations with their tenant's ticket and priority (tenancy/admission.py), when
    the app admits by tenant; 429 past the tenant's limits. `close_tickets` when the client request ends."""
    sidecar = http_request.app.get(SIDECAR)
    if sidecar is not None:  # behind a gateway whose picker applied the tenants' limits
        return sidecar.admit(http_request, requests)
    admission = http_request.app.get(ADMISSION)
    return admission.admit(http_request, requests) if admission is not None else requests


async def stream_events(http_request: web.Request, events: AsyncIterator[GenerationEvent], writers: list[TokenWriter],
                        request_id: str) -> web.StreamResponse:
    """Write a stream of events: one generation's, or several generations' merged into one (choices.py); an event's
    `choice` is the index of the writer that formats it, and the first writer's formatter frames the stream."""
    framing = writers[0].formatter
    response: web.StreamResponse | None = None
    tail: list[dict | str] = []  # the frames that end a generation: written with whatever comes next, or last
    try:
        async for event in events:
            writer = writers[event.choice]
            writer.busy = True  # until this event is written: a token's frame must not overtake it
            writer.flush()  # tokens its frames took are always flushed before; this holds even if one was not
            kind = event.__class__
            if response is None:
                if kind is Failed:
                    raise event.error
                # Opened on the first event, so a failure before it is a plain HTTP error.
                # The event is written right below (an empty write sends the head too).
                response = await open_stream(http_request, framing.stream_content_type, head_with_first_chunk=True)
                for each in writers:
                    each.open(http_request, response)
            elif tail:  # another generation ended before this event
                await response.write(b"".join(map(framing.encode, tail)))
                tail = []
            if kind is TokenDelta:
                writer.transcript.add(event)
                await response.write(writer.token_data(event))
                writer.busy = False
            elif kind is Finished:
                writer.transcript.finished = event
                tail = writer.formatter.final_frames(event, writer.transcript)
            else:  # Failed: one of several generations ended with an error; the others go on
                tail = _failed_frames(http_request, request_id, event.error, writer)
    except ApiError as error:
        if response is None:
            raise
        tail = _failed_frames(http_request, request_id, error, writers[0])
    finally:
        for writer in writers:
            writer.busy = True  # the rest of the stream is written here
        await events.aclose()
    if response is not None:
        for writer in writers:
            writer.flush()
    if framing.done_marker is not None:
        tail.append(framing.done_marker)
    # The last chunk, usage, the done marker and the end of the body leave in one write.
    await response.write_eof(b"".join(map(framing.encode, tail)))
    return response


def _failed_frames(http_request: web.Request, request_id: str, error: ApiError, writer: TokenWriter) -> list[dict]:
    """The frames that end a generation that failed mid-stream, counted as a failed request."""
    logger.warning("request %s failed mid-stream: %s", request_id, error.message)
    http_request.app[METRICS].fail(api_label(http_request), error.status)
    return writer.formatter.error_frames(error, writer.transcript)


class TokenWriter:
    """Writes a streamed generation's tokens; as the pipeline's TokenListener it writes a token straight from its
    token channel frame (one callback, no wake-up of the request's task), when the client keeps up."""

    # Above this many unsent bytes the client is behind: its tokens go through the task, which waits for it.
    HIGH_WATER = 64 * 1024

    def __init__(self, formatter: ResponseFormatter, transcript: Transcript):
        self.formatter = formatter
        self.transcript = transcript
        self.busy = False  # the task is writing an event: a token written now would overtake it
        self._transport = None  # set once the stream is open with chunked framing, which `write` frames itself
        self._unsent: list[bytes] = []  # chunks `write` framed, sent by `flush`

    def open(self, http_request: web.Request, response: web.StreamResponse) -> None:
        if response.chunked:
            self._transport = http_request.transport

    def take(self, token, to_delta) -> bool:
        if token.finish_reason or self.busy:
            return False
        transport = self._transport
        if transport is None or transport.is_closing() or transport.get_write_buffer_size() > self.HIGH_WATER:
            return False
        self.write(to_delta(token))
        return True

    def write(self, delta: TokenDelta) -> None:
        self.transcript.add(delta)
        data = self.token_data(delta)
        if data:  # one HTTP/1.1 chunk, as aiohttp's StreamResponse.write frames it (an empty one would end the body)
            self._unsent.append(b"%x\r\n%b\r\n" % (len(data), data))

    def flush(self) -> None:
        unsent = self._unsent
        if unsent:
            if not self._transport.is_closing():  # a client that left gets nothing more
                self._transport.write(unsent[0] if len(unsent) == 1 else b"".join(unsent))
            unsent.clear()

    def token_data(self, delta: TokenDelta) -> bytes:
        """A token's stream bytes (after it was recorded in the transcript)."""
        formatter = self.formatter
        data = formatter.token_bytes(delta, self.transcript)
        if data is None:
            data = b"".join(map(formatter.encode, formatter.token_frames(delta, self.transcript)))
        return data


class SseFormatter:
    """Default framing: server-sent `data:` events."""

    done_marker: str | None = None
    stream_content_type = "text/event-stream; charset=utf-8"

    def encode(self, frame: dict | str) -> bytes:
        return encode_event(frame)

    def token_bytes(self, delta: TokenDelta, transcript: Transcript) -> bytes | None:
        return None


def record(transcript: Transcript, event) -> None:
    """Add one event to a transcript."""
    if isinstance(event, TokenDelta):
        transcript.add(event)
    else:
        transcript.finished = event


def json_dumps(obj) -> str:
    return orjson.dumps(obj, option=JSON_OPTIONS).decode("utf-8")
