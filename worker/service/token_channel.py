"""A worker's token channels: one raw connection per coordinator carries that coordinator's requests and
every event of theirs, one write per event-loop turn (so one per decode step), where gRPC would cost a call
per request and a message and a wake-up per token on both ends. A decode worker's carry decode requests, a
prefill worker's carry prefills (each answered by one `prefilled` event).

Life of a channel:
  1. A coordinator connects (TLS as tls_config.worker_grpc, when it is on) and sends a
     TokenChannelHello with the worker secret (when one is set) within HELLO_TIMEOUT_S, and whether it reads
     token records.
  2. The worker names the channel with a random id in its first frame (or says why it refused, and
     closes).
  3. Each TokenChannelRequest `decode` (`prefill`) runs as a Decode (Prefill) call would: the same
     servicer code, with a context whose abort becomes an `error` event, under its `timeout_s`; its
     accepted, tokens, answer and error are queued as events, and the queue is written as one frame, in
     one write, when the event loop turn that filled it ends (where the hello asked for them, each run of
     common tokens as a frame of fixed binary token records instead: proto/token_channel.py). `cancel`
     ends one at once; `health` is answered at once, as the Health call; `watch_kv_events` subscribes the channel to the worker's KV events (a
     snapshot, then every change, in the frames' `kv_events`; asked again, a new snapshot). A request of the
     other role's kind is refused with UNIMPLEMENTED.
  4. When the connection closes, its requests are cancelled and released, and its KV events subscription ends.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import ssl

import grpc

from proto import worker_pb2 as pb
from proto.failure_reason import reason_from_metadata
from proto.token_channel import (HELLO_TIMEOUT_S, MAX_FRAME_BYTES, MAX_HELLO_BYTES, ChannelState, FrameError,
                                 FrameReader, TokenRecords, encode_frame, encode_records)
from security.secrets import SecretFile
from security.tls import LinkTls
from worker.service.kv_event_log import KvEventLog

logger = logging.getLogger(__name__)

# Tokens are tiny and the coordinator reads them as they come; this much unread means it stopped reading.
MAX_UNREAD_BYTES = 16 << 20


class ChannelAbort(Exception):
    """A channel request ended with a status and a FailureReason, as a gRPC call's abort ends it."""

    def __init__(self, code: grpc.StatusCode, details: str, reason: int = pb.FAILURE_REASON_UNSPECIFIED):
        super().__init__(details)
        self.code = code
        self.details = details
        self.reason = reason


class ChannelCallContext:
    """What the Decode servicer uses of a gRPC context, for a request on a channel."""

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()):
        raise ChannelAbort(code, details, reason_from_metadata(trailing_metadata))


async def serve_as_call(channel: CoordinatorConnection, kind: str, request_id: str, timeout_s: float, work) -> None:
    """Run a channel request's `work` (a coroutine) as its gRPC call would run, under its deadline: an abort,
    the deadline or an unexpected error end it with the `error` event carrying that call's status."""
    try:
        async with asyncio.timeout(timeout_s if timeout_s > 0 else None):
            await work
    except ChannelAbort as abort:
        channel.send_error(request_id, abort.code.name, abort.details, abort.reason)
    except TimeoutError:
        # In gRPC's own words for a call whose deadline passed; the reason tells it apart from an abort.
        channel.send_error(request_id, grpc.StatusCode.DEADLINE_EXCEEDED.name, "Deadline Exceeded",
                           pb.FAILURE_REASON_CALL_DEADLINE)
    except Exception as exc:  # noqa: BLE001 - what a gRPC call ends with on an unexpected error: UNKNOWN
        logger.exception("%s request %s failed", kind, request_id)
        channel.send_error(request_id, grpc.StatusCode.UNKNOWN.name, f"unexpected error on the worker: {exc}")


class CoordinatorConnection(asyncio.Protocol):
    """One coordinator's connection: its decode requests, and their events written once per loop turn."""

    def __init__(self, listener: TokenChannelListener):
        self.listener = listener
        self.state = ChannelState.GREETING
        self.channel_id = ""
        self.tasks: dict[str, asyncio.Task] = {}  # the decodes running for this channel, by request id
        self._reader = FrameReader(MAX_HELLO_BYTES)
        self._pending: list[pb.RoutedEvent | bytes] = []  # events, and token records (proto/token_channel.py)
        self.token_records = False  # the coordinator's hello asked for token records
        self._pending_kv: list[pb.KvEventBatch] = []
        self._watching_kv = False
        self._transport: asyncio.Transport | None = None
        self._hello_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._hello_timer = asyncio.get_running_loop().call_later(HELLO_TIMEOUT_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._reader.feed(data)
        except FrameError:
            self._transport.abort()
            return
        for frame in frames:
            if frame.__class__ is TokenRecords:  # only a worker sends them
                self._transport.abort()
                return
            if self.state is ChannelState.GREETING:
                self._hello_timer.cancel()
                self._greet(frame)
            elif self.state is ChannelState.OPEN:
                self._request(frame)

    def _request(self, frame: bytes) -> None:
        request = pb.TokenChannelRequest()
        try:
            request.ParseFromString(frame)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError: not a coordinator speaking
            self._transport.abort()
            return
        kind = request.WhichOneof("kind")
        if kind == "cancel":
            task = self.tasks.get(request.cancel)
            if task is not None:
                task.cancel()
            return
        if kind == "health":
            self._answer_health(request.health)
            return
        if kind == "watch_kv_events":
            self._watch_kv_events()
            return
        body = getattr(request, kind) if kind is not None else None
        request_id = body.request_id if body is not None else ""
        if kind != self.listener.kind:
            self.send_error(request_id, "UNIMPLEMENTED", f"this is a {self.listener.kind} worker's channel: "
                                                         f"no {kind} requests")
            return
        if request_id in self.tasks:
            self.send_error(request_id, "ALREADY_EXISTS", f"request {request_id!r} already runs on this channel")
            return
        task = asyncio.ensure_future(self.listener.serve(self, body, request.timeout_s))
        self.tasks[request_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(request_id, None))

    def _answer_health(self, probe_id: str) -> None:
        try:
            self.send(pb.RoutedEvent(request_id=probe_id, health=self.listener.health()))
        except Exception as exc:  # noqa: BLE001 - a failed probe fails the probe, not the channel's other requests
            logger.exception("health probe on token channel %s failed", self.channel_id)
            self.send_error(probe_id, grpc.StatusCode.UNKNOWN.name, f"unexpected error on the worker: {exc}")

    def _watch_kv_events(self) -> None:
        log = self.listener.kv_events
        if log is None:
            self.send_error("", "UNIMPLEMENTED", "this worker publishes no KV events")
            return
        log.unsubscribe(self.send_kv_events)  # asked again: a fresh snapshot (the coordinator lost track)
        self._watching_kv = True
        log.subscribe(self.send_kv_events)

    def send_kv_events(self, batch: pb.KvEventBatch) -> None:
        """Queue a KV events batch for this turn's frame."""
        if not self._pending and not self._pending_kv:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending_kv.append(batch)

    def _greet(self, frame: bytes) -> None:
        hello = pb.TokenChannelHello()
        try:
            hello.ParseFromString(frame)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError; any garbage is a refusal
            return self._refuse("the hello is not a TokenChannelHello")
        secret = self.listener.secret
        if secret is not None and not secret.matches(hello.worker_secret):
            return self._refuse("missing or wrong worker secret")
        self.channel_id = secrets.token_hex(16)
        self.token_records = hello.token_records
        self.state = ChannelState.OPEN
        self._reader.max_frame_bytes = MAX_FRAME_BYTES  # a decode request carries a prompt and maybe a grammar
        self.listener.channels[self.channel_id] = self
        self._write(pb.TokenChannelFrame(channel_id=self.channel_id, answers_health=True,
                                         streams_kv_events=self.listener.kv_events is not None))

    def _refuse(self, reason: str) -> None:
        logger.warning("token channel refused: %s", reason)
        self.state = ChannelState.CLOSED  # nothing more it sent is read
        self._write(pb.TokenChannelFrame(refused=reason))
        self._transport.close()

    def send_accepted(self, request_id: str, accepted: pb.Accepted) -> None:
        self.send(pb.RoutedEvent(request_id=request_id, accepted=accepted))

    def send_error(self, request_id: str, code: str, details: str,
                   reason: int = pb.FAILURE_REASON_UNSPECIFIED) -> None:
        self.send(pb.RoutedEvent(request_id=request_id, error=pb.ChannelError(code=code, details=details,
                                                                              reason=reason)))

    def send(self, event: pb.RoutedEvent) -> None:
        """Queue an event; the first one queued in a loop turn schedules the turn's single write."""
        if not self._pending and not self._pending_kv:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(event)

    def _flush(self) -> None:
        events, self._pending = self._pending, []
        kv_events, self._pending_kv = self._pending_kv, []
        if self.state is not ChannelState.OPEN:
            return
        # A snapshot's batches (up to SNAPSHOT_BATCH_EVENTS blocks each) go in frames of their own, in order with the
        # changes: a large cache in one frame could pass the frame limit.
        out: list[bytes] = []  # the turn's frames, in one write
        changes = []
        for batch in kv_events:
            if batch.snapshot:
                if changes:
                    out.append(_frame(pb.TokenChannelFrame(kv_events=changes)))
                    changes = []
                out.append(_frame(pb.TokenChannelFrame(kv_events=[batch])))
            else:
                changes.append(batch)
        if events or changes:
            _event_frames(events, changes, out)
        if out:
            self._transport.write(out[0] if len(out) == 1 else b"".join(out))
        if self._transport.get_write_buffer_size() > MAX_UNREAD_BYTES:
            logger.warning("token channel %s: the coordinator stopped reading; closing it", self.channel_id)
            self._transport.abort()

    def _write(self, frame: pb.TokenChannelFrame) -> None:
        self._transport.write(_frame(frame))

    def connection_lost(self, exc: Exception | None) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self.state = ChannelState.CLOSED
        self.listener.channels.pop(self.channel_id, None)
        if self._watching_kv:
            self.listener.kv_events.unsubscribe(self.send_kv_events)
        for task in self.tasks.values():  # nobody reads their events any more
            task.cancel()


def _frame(frame: pb.TokenChannelFrame) -> bytes:
    return encode_frame(frame.SerializeToString())


def _event_frames(events: list[pb.RoutedEvent | bytes], changes: list[pb.KvEventBatch], out: list[bytes]) -> None:
    """A turn's events in order onto `out`: each run of token records as a records frame, each run of RoutedEvents
    (the last with the KV changes) as a TokenChannelFrame."""
    routed: list[pb.RoutedEvent] = []
    records: list[bytes] = []
    for event in events:
        if event.__class__ is bytes:
            if routed:
                out.append(_frame(pb.TokenChannelFrame(events=routed)))
                routed = []
            records.append(event)
        else:
            if records:
                out.append(encode_records(records))
                records = []
            routed.append(event)
    if records:
        out.append(encode_records(records))
    if routed or changes:
        out.append(_frame(pb.TokenChannelFrame(events=routed, kv_events=changes)))


class TokenChannelListener:
    """Accepts coordinators' token channels; `channels` maps each open one's id to it."""

    def __init__(self, serve, health, secret: SecretFile | None = None, tls: LinkTls | None = None,
                 kind: str = "decode", kv_events: KvEventLog | None = None):
        # serve(channel, request, timeout_s): runs one request of a channel, a pb.DecodeRequest or, with
        # kind "prefill", a pb.PrefillRequest; health(): the worker's pb.HealthResponse now
        self.serve = serve
        self.health = health
        self.kind = kind
        self.kv_events = kv_events  # this worker's KV event log, for `watch_kv_events`
        self.secret = secret
        self.tls = tls
        self.channels: dict[str, CoordinatorConnection] = {}
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int = 0) -> int:
        """Listen; returns the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: CoordinatorConnection(self), host, port,
                                                ssl=self._ssl_context())
        return self._server.sockets[0].getsockname()[1]

    def _ssl_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        base = self.tls.ssl_context()

        def current_material(ssl_object, server_name, _context):
            # Each handshake takes the material current now, so a SIGHUP reload reaches new channels.
            ssl_object.context = self.tls.ssl_context()

        base.sni_callback = current_material
        return base

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for channel in list(self.channels.values()):
                channel._transport.close()
            await self._server.wait_closed()
