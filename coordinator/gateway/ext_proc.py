"""Envoy's ext_proc v3 `Process` stream as the Endpoint Picker protocol (GIE proposal 004): one stream, one request.

The life of one stream:
  1. request_headers: kept. A request without a body is picked at once; in BUFFERED mode the headers are answered
     with an empty CONTINUE (Envoy waits for that answer before it buffers the body).
  2. request_body: FULL_DUPLEX_STREAMED chunks are gathered until end_of_stream, then the request is picked and
     the held headers are answered (destination header and metadata) before the body is echoed back in chunks of
     at most MAX_BODY_CHUNK; in BUFFERED mode the one body message is picked and the header changes ride its answer.
  3. response_headers: the endpoint that served is read back and reported to the pick.
  4. The stream ends (Envoy done, client gone): the pick is closed, once.
A refused pick is answered by Envoy itself with an OpenAI-shaped JSON error (ImmediateResponse).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf import struct_pb2

from coordinator.errors import ApiError
from coordinator.gateway.endpoint_pick import (DESTINATION_HEADER, LB_NAMESPACE, MAX_BODY_CHUNK, SERVED_KEY,
                                               SUBSET_HEADER, SUBSET_NAMESPACE, EndpointPick, EndpointPicker,
                                               GatewayRequest, PickRefused)
from proto import ext_proc_pb2 as ep

logger = logging.getLogger(__name__)

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"  # Envoy calls /SERVICE/Process
ProcessingMode = ep.ProcessingMode
FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
# Modes where Envoy holds the whole body and sends it in one message after the headers are answered.
_BUFFERED = (ProcessingMode.BUFFERED, ProcessingMode.BUFFERED_PARTIAL)
_CONTINUE = ep.CommonResponse()


def ext_proc_handler(servicer: ExternalProcessorServicer) -> grpc.GenericRpcHandler:
    """The servicer's Process as Envoy's ExternalProcessor service, for a gRPC server."""
    return grpc.method_handlers_generic_handler(SERVICE, {"Process": grpc.stream_stream_rpc_method_handler(
        servicer.Process, request_deserializer=ep.ProcessingRequest.FromString,
        response_serializer=ep.ProcessingResponse.SerializeToString)})


def process_call(channel: grpc.aio.Channel):
    """A client's ExternalProcessor.Process call on `channel`, as Envoy makes it (tests and benchmarks)."""
    return channel.stream_stream(f"/{SERVICE}/Process", request_serializer=ep.ProcessingRequest.SerializeToString,
                                 response_deserializer=ep.ProcessingResponse.FromString)


class ExternalProcessorServicer:
    """Answers each ext_proc stream with the picker's choice.

    `body_mode` is the request body mode assumed when Envoy's first message carries no protocol_config (Envoys
    before 1.33 send none); `on_picked(seconds)` observes the time from stream open to the pick."""

    def __init__(self, picker: EndpointPicker, *, on_picked: Callable[[float], None] | None = None,
                 body_mode: int = FULL_DUPLEX):
        self._picker = picker
        self._on_picked = on_picked
        self._body_mode = body_mode

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[ep.ProcessingResponse]:
        stream = _RequestStream(self._picker, self._on_picked, self._body_mode)
        try:
            async for message in request_iterator:
                for response in await stream.answer(message):
                    yield response
        finally:
            stream.close()


class _RequestStream:
    """The state of one ext_proc stream: what was seen of the request, and its pick once made."""

    def __init__(self, picker: EndpointPicker, on_picked: Callable[[float], None] | None, body_mode: int):
        self._picker = picker
        self._on_picked = on_picked
        self._opened = time.monotonic()
        self.request_body_mode = body_mode
        self.response_body_mode = ProcessingMode.NONE
        self._headers: dict[str, str] = {}
        self._subset: list[str] | None = None
        self._body = bytearray()
        self._body_seen = False  # FULL_DUPLEX_STREAMED body chunks arrived: they must be echoed back
        self._pick: EndpointPick | None = None
        self._answered = False  # an ImmediateResponse was sent: Envoy ends the stream, later messages are ignored

    async def answer(self, message: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        if message.HasField("protocol_config"):
            self.request_body_mode = message.protocol_config.request_body_mode
            self.response_body_mode = message.protocol_config.response_body_mode
        if self._answered:
            return []
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(message)
        if kind == "request_body":
            return await self._request_body(message.request_body)
        if kind == "request_trailers":
            return await self._request_trailers()
        if kind == "response_headers":
            return [self._response_headers(message)]
        if kind == "response_body":
            return self._response_body(message.response_body)
        if kind == "response_trailers":
            return [ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]
        logger.warning("ext_proc message of unknown kind %r ignored", kind)
        return []

    def close(self) -> None:
        if self._pick is None:
            return
        pick, self._pick = self._pick, None
        try:
            pick.close()
        except Exception:
            logger.exception("closing the pick of %s failed", self._headers.get(":path", "?"))

    # request ---------------------------------------------------------------------------------------

    async def _request_headers(self, message: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        self._headers = _header_dict(message.request_headers.headers)
        self._subset = _subset_hint(message, self._headers)
        if message.request_headers.end_of_stream or not (
                self.request_body_mode == FULL_DUPLEX or self.request_body_mode in _BUFFERED):
            # No body, or none that Envoy will show before the headers go on: pick on the headers.
            return await self._pick_and_answer()
        if self.request_body_mode == FULL_DUPLEX:
            return []  # held until the body has been read
        return [ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=_CONTINUE))]

    async def _request_body(self, body: ep.HttpBody) -> list[ep.ProcessingResponse]:
        if self.request_body_mode in _BUFFERED:
            self._body = bytearray(body.body)
            return await self._pick_and_answer(on_body=True)
        if self.request_body_mode != FULL_DUPLEX:
            return [ep.ProcessingResponse(request_body=ep.BodyResponse(response=_CONTINUE))]
        self._body += body.body
        self._body_seen = True
        if not body.end_of_stream:
            return []
        return await self._pick_and_answer()

    async def _request_trailers(self) -> list[ep.ProcessingResponse]:
        trailers = [ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]
        if self.request_body_mode == FULL_DUPLEX and self._pick is None:
            # Trailers end the body (its last chunk had no end_of_stream): pick now, the echoed body ends open.
            return await self._pick_and_answer(end_of_stream=False) + trailers
        return trailers

    async def _pick_and_answer(self, *, on_body: bool = False, end_of_stream: bool = True
                               ) -> list[ep.ProcessingResponse]:
        """Pick, then answer the held headers (or, `on_body`, the buffered body) with the pick's changes; body chunks
        Envoy streamed are echoed after the headers, `end_of_stream` on the last unless trailers follow."""
        received = bytes(self._body)
        try:
            self._pick = await self._picker.pick(GatewayRequest(self._headers, received, self._subset))
        except PickRefused as refused:
            return [self._refuse(refused.status, refused.message, refused.headers)]
        except Exception:
            logger.exception("the endpoint picker failed on %s", self._headers.get(":path", "?"))
            return [self._refuse(500, "the gateway could not pick an endpoint", {})]
        if self._on_picked is not None:
            self._on_picked(time.monotonic() - self._opened)
        body = received if self._pick.body is None else self._pick.body
        common = ep.CommonResponse(header_mutation=self._header_mutation(body, received),
                                   clear_route_cache=True)
        metadata = _destination_metadata(self._pick.destination)
        if on_body:
            if body != received:
                common.body_mutation.body = body
            return [ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata)]
        answers = [ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common),
                                         dynamic_metadata=metadata)]
        if self._body_seen:
            answers += _streamed_body(body, end_of_stream)
        return answers

    def _header_mutation(self, body: bytes, received: bytes) -> ep.HeaderMutation:
        pick = self._pick
        values = {DESTINATION_HEADER: pick.destination, **pick.set_headers}
        if len(body) != len(received) and "content-length" in self._headers:
            values["content-length"] = str(len(body))
        return ep.HeaderMutation(set_headers=[_header(k, v) for k, v in values.items()],
                                 remove_headers=list(pick.remove_headers))

    def _refuse(self, status: int, message: str, headers: dict[str, str]) -> ep.ProcessingResponse:
        self._answered = True
        error_type = ApiError(status, message).error_type
        body = json.dumps({"error": {"message": message, "type": error_type, "param": None, "code": status}})
        values = {"content-type": "application/json", **headers}
        return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
            status=ep.HttpStatus(code=status),
            headers=ep.HeaderMutation(set_headers=[_header(k, v) for k, v in values.items()]),
            body=body.encode(), details=f"endpoint_pick_refused_{status}"))

    # response --------------------------------------------------------------------------------------

    def _response_headers(self, message: ep.ProcessingRequest) -> ep.ProcessingResponse:
        headers = _header_dict(message.response_headers.headers)
        served = _metadata_value(message, LB_NAMESPACE, SERVED_KEY) or headers.get(SERVED_KEY)
        if isinstance(served, list):
            served = served[0] if served else None
        if served and self._pick is not None:
            try:
                self._pick.served(served)
            except Exception:
                logger.exception("reporting the served endpoint %s failed", served)
        # The served address is for the gateway, not for clients.
        mutation = ep.HeaderMutation(remove_headers=[SERVED_KEY]) if SERVED_KEY in headers else None
        return ep.ProcessingResponse(response_headers=ep.HeadersResponse(
            response=ep.CommonResponse(header_mutation=mutation)))

    def _response_body(self, body: ep.HttpBody) -> list[ep.ProcessingResponse]:
        if self.response_body_mode == FULL_DUPLEX:
            return _streamed_body(body.body, body.end_of_stream, response=True)
        return [ep.ProcessingResponse(response_body=ep.BodyResponse(response=_CONTINUE))]


def _streamed_body(body: bytes, end_of_stream: bool, response: bool = False) -> list[ep.ProcessingResponse]:
    """`body` as FULL_DUPLEX_STREAMED answers in order, each at most MAX_BODY_CHUNK, the last ending the stream."""
    chunks = [body[i:i + MAX_BODY_CHUNK] for i in range(0, len(body), MAX_BODY_CHUNK)] or [b""]
    answers = []
    for i, chunk in enumerate(chunks):
        common = ep.CommonResponse()
        common.body_mutation.streamed_response.body = chunk
        common.body_mutation.streamed_response.end_of_stream = end_of_stream and i == len(chunks) - 1
        answer = ep.BodyResponse(response=common)
        answers.append(ep.ProcessingResponse(response_body=answer) if response
                       else ep.ProcessingResponse(request_body=answer))
    return answers


def _header(key: str, value: str) -> ep.HeaderValueOption:
    return ep.HeaderValueOption(header=ep.HeaderValue(key=key, raw_value=value.encode()),
                                      append_action=ep.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def _header_dict(headers) -> dict[str, str]:
    """Lower-case names to values; Envoy sends raw_value (bytes) unless told otherwise, older ones `value`."""
    return {h.key.lower(): h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
            for h in headers.headers}


def _metadata_value(message: ep.ProcessingRequest, namespace: str, key: str):
    fields = message.metadata_context.filter_metadata
    if namespace not in fields or key not in fields[namespace].fields:
        return None
    value = fields[namespace].fields[key]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.string_value]
    return value.string_value if kind == "string_value" else None


def _subset_hint(message: ep.ProcessingRequest, headers: dict[str, str]) -> list[str] | None:
    hint = _metadata_value(message, SUBSET_NAMESPACE, SUBSET_HEADER)
    if hint is None:
        hint = headers.get(SUBSET_HEADER)
    if hint is None:
        return None
    parts = hint if isinstance(hint, list) else hint.split(",")
    return [p.strip() for p in parts if p.strip()]


def _destination_metadata(destination: str) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: destination}})
    return metadata
