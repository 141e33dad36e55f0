"""The coordinator's side of the token channels (life cycle in worker/service/token_channel.py): one
connection per worker, dialled in the background once the worker names its listener (a decode worker in an
`accepted`, a prefill worker in a Prefill answer; until then, and whenever it is down, requests take gRPC
calls). Decode requests or prefills go out on it; each frame's events go to the TokenSink of their request
as the frame arrives, and its KV events batches (once `watch_kv_events` asked for them) to `kv_events_sink`."""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import time
from collections.abc import Callable

from coordinator.requests.failures import WorkerCallError, WorkerFailure
from proto import worker_pb2 as pb
from proto.token_channel import ChannelState, FrameError, FrameReader, TokenRecords, encode_frame, read_records
from security.secrets import SecretFile
from security.tls import LinkTls

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S = 10, 5
# After a failed dial, requests to that worker use their gRPC streams this long before the next try.
REDIAL_AFTER_S = 5.0


class TokenSink:
    """The events of one request on a channel (or on a vLLM instance's stream: vllm/decode_stream.py), read in order by its attempt; or, while nothing is queued and
    `direct` takes them, handed to `direct` inside the frame's own callback (no wake-up of the attempt's task),
    and sent by `flush` once every frame of that socket read is handed out (tokens of one request that came in
    one read leave in one write: none waits for a later read)."""

    __slots__ = ("_items", "_waiter", "_lost", "_failed", "_loop", "_unflushed", "direct", "flush")

    def __init__(self):
        self._items: collections.deque[pb.RoutedEvent] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._lost: WorkerCallError | None = None  # the channel closed under it
        self._failed: Exception | None = None  # `direct` raised: the request is over, whatever came after
        self._loop = asyncio.get_running_loop()
        self._unflushed = False  # `direct` took an event since the last flush
        # Returns whether it consumed the event; False leaves it to the queue, as do queued events before it.
        self.direct: Callable[[pb.RoutedEvent], bool] | None = None
        self.flush: Callable[[], None] | None = None

    def push(self, event: pb.RoutedEvent) -> bool:
        """Queue or hand over one event; True when it is the first `direct` took since the last `flush_direct`
        (the channel then owes this sink a flush at the end of the read)."""
        if self._failed is not None:
            return False
        direct = self.direct
        if direct is not None and not self._items and self._lost is None:
            try:
                if direct(event):
                    first, self._unflushed = not self._unflushed, True
                    return first
            except Exception as exc:  # noqa: BLE001 - the request's own failure, raised in its task, not the channel's
                self.flush_direct()  # the tokens taken before this one came before the failure
                self._fail(exc)
                return False
        self._items.append(event)
        self._wake()
        return False

    def deliver_tokens(self, take: Callable[[pb.TokenEvent], bool], flush: Callable[[], None], routed: bool) -> None:
        """Hand tokens to `take` inside the read's callback (it returns whether it took one; it refuses the last
        token and whatever it cannot write now), and call `flush` once that read is handed out; what `take`
        refuses, an end and any failure stay for `next`, in order. `routed`: the events are a channel's
        pb.RoutedEvents (the token unwrapped), else tokens, with None as the end."""
        if routed:
            def direct(event) -> bool:
                return event.WhichOneof("event") == "token" and take(event.token)
        else:
            def direct(event) -> bool:
                return event is not None and take(event)

        self.direct = direct
        self.flush = flush

    def flush_direct(self) -> None:
        """Send what `direct` took from the frames of this read (before any queued event is read: the task
        runs only after the read's callback)."""
        self._unflushed = False
        if self.flush is not None and self._failed is None:
            try:
                self.flush()
            except Exception as exc:  # noqa: BLE001 - as in push
                self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        self.direct = self.flush = None
        self._failed = exc
        self._wake()

    def lose(self, error: WorkerCallError) -> None:
        """No more events will come: the channel is gone."""
        self._lost = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self) -> pb.RoutedEvent:
        """The next event; raises the channel's loss once the events that came before it are read, and a failure
        of `direct` at once (the events after the one it failed on must not reach the client)."""
        while self._failed is not None or not self._items:
            if self._failed is not None:
                raise self._failed
            if self._lost is not None:
                raise self._lost
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class TokenChannel(asyncio.Protocol):
    """One worker's channel: hands each event to its request's sink."""

    def __init__(self, worker_address: str, listener_address: str, role: str = "decode"):
        self.worker_address = worker_address
        self.listener_address = listener_address
        self.role = role  # the worker's: the stage a lost channel fails its requests at
        self.state = ChannelState.GREETING
        self.channel_id = ""
        self.answers_health = False  # the worker said so in its first frame (older workers cannot)
        self.streams_kv_events = False  # likewise: it takes `watch_kv_events`
        self.sinks: dict[str, TokenSink] = {}
        self.kv_events_sink: Callable[[pb.KvEventBatch], None] | None = None
        loop = asyncio.get_running_loop()
        self.opened: asyncio.Future = loop.create_future()
        self.closed: asyncio.Future = loop.create_future()  # done when the connection is gone
        self._reader = FrameReader()
        self._transport: asyncio.Transport | None = None
        self._lost_reason = ""  # set when the coordinator drops the channel itself

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        keep_alive(transport)

    def hello(self, secret: SecretFile | None) -> None:
        self._transport.write(encode_frame(pb.TokenChannelHello(
            worker_secret=secret.value if secret is not None else "", token_records=True).SerializeToString()))

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._reader.feed(data)
        except FrameError as exc:
            self._broken(exc)
            return
        unflushed: list[TokenSink] = []
        try:
            for payload in frames:
                if payload.__class__ is TokenRecords:  # the common tokens, each its own RoutedEvent
                    try:
                        events = read_records(payload)
                    except FrameError as exc:
                        self._broken(exc)
                        return
                else:
                    frame = pb.TokenChannelFrame()
                    frame.ParseFromString(payload)
                    if self.state is ChannelState.GREETING:
                        self._greeted(frame)
                        continue
                    if self.kv_events_sink is not None and frame.kv_events:  # a repeated field read makes an object
                        self._kv_events(frame.kv_events)
                    events = frame.events
                sinks = self.sinks
                for event in events:
                    sink = sinks.get(event.request_id)
                    # A request that ended (client gone) may still have events in flight.
                    if sink is not None and sink.push(event):
                        unflushed.append(sink)
        finally:  # what was taken leaves, whatever a later frame of the read did
            for sink in unflushed:
                sink.flush_direct()

    def _broken(self, exc: FrameError) -> None:
        logger.warning("token channel to %s: %s", self.worker_address, exc)
        self.abort(f"token channel to {self.worker_address} broken: {exc}")

    def _kv_events(self, batches) -> None:
        try:
            for batch in batches:
                if self.kv_events_sink is not None:
                    self.kv_events_sink(batch)
        except Exception:  # noqa: BLE001 - the index's trouble must not cut the channel its requests stream on
            logger.exception("KV events from %s: a batch could not be applied; no longer followed here",
                             self.worker_address)
            self.kv_events_sink = None

    def _greeted(self, frame: pb.TokenChannelFrame) -> None:
        if not frame.channel_id:
            logger.warning("decode worker %s refused the token channel: %s", self.worker_address, frame.refused)
            self._transport.close()
            return
        self.channel_id = frame.channel_id
        self.answers_health = frame.answers_health
        self.streams_kv_events = frame.streams_kv_events
        self.state = ChannelState.OPEN
        if not self.opened.done():
            self.opened.set_result(None)

    def submit(self, request_id: str, request: pb.TokenChannelRequest) -> TokenSink:
        """Send a decode or prefill request; its events come to the returned sink."""
        sink = self.sinks[request_id] = TokenSink()
        self._send(request)
        return sink

    def watch_kv_events(self, sink: Callable[[pb.KvEventBatch], None]) -> None:
        """Have the worker send its KV events on this channel (a snapshot first; asked again, a new one) to `sink`."""
        self.kv_events_sink = sink
        self._send(pb.TokenChannelRequest(watch_kv_events=pb.WatchKvEventsRequest()))

    def release(self, request_id: str, cancel: bool) -> None:
        """Forget a request; with `cancel`, the worker still runs it and is told to stop."""
        if self.sinks.pop(request_id, None) is not None and cancel and self.state is ChannelState.OPEN:
            self._send(pb.TokenChannelRequest(cancel=request_id))

    def _send(self, request: pb.TokenChannelRequest) -> None:
        self._transport.write(encode_frame(request.SerializeToString()))

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = ChannelState.CLOSED
        if not self.closed.done():
            self.closed.set_result(None)
        if not self.opened.done():
            self.opened.set_exception(ConnectionError(f"closed before the worker named the channel: {exc}"))
            self.opened.exception()  # retrieved: the dialler reports it
        error = WorkerCallError(WorkerFailure(self.role, self.worker_address, "UNAVAILABLE",
                                              self._lost_reason or f"token channel lost: {exc or 'closed'}"))
        for sink in self.sinks.values():
            sink.lose(error)
        self.sinks.clear()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def abort(self, reason: str) -> None:
        """Drop the connection now, unsent bytes and all (the worker is not reading): its requests fail as
        UNAVAILABLE with `reason`."""
        self._lost_reason = reason
        if self._transport is not None:
            self._transport.abort()


def keep_alive(transport: asyncio.Transport) -> None:
    """TCP keepalive on a channel: a peer that vanished without a reset (a dead host, a cut link) is found
    within about KEEPALIVE_IDLE_S + 3 x KEEPALIVE_INTERVAL_S instead of never, failing its requests."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                          ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class TokenChannels:
    """The coordinator's token channels, one per worker, opened once a worker names its listener."""

    def __init__(self, tls: LinkTls | None = None, secret: SecretFile | None = None):
        self.tls = tls
        self.secret = secret
        self._channels: dict[str, TokenChannel] = {}
        # Told of each channel that opens (the KV event watch moves its subscription onto it).
        self.on_open: list[Callable[[str, TokenChannel], None]] = []
        self._dialling: dict[str, asyncio.Task] = {}
        self._failed_at: dict[str, float] = {}

    def open_channel(self, worker_address: str) -> TokenChannel | None:
        """The worker's open channel, or None (its tokens come on each request's stream meanwhile)."""
        channel = self._channels.get(worker_address)
        if channel is not None and channel.state is ChannelState.OPEN:
            return channel
        return None

    def learn(self, worker_address: str, channel_address: str, role: str = "decode") -> None:
        """A `role` worker named its listener: dial it in the background unless a channel is open or being
        opened."""
        if not channel_address or self.open_channel(worker_address) is not None or worker_address in self._dialling:
            return
        if time.monotonic() - self._failed_at.get(worker_address, -REDIAL_AFTER_S) < REDIAL_AFTER_S:
            return
        task = asyncio.create_task(self._dial(worker_address, channel_address, role))
        self._dialling[worker_address] = task
        task.add_done_callback(lambda _: self._dialling.pop(worker_address, None))

    async def _dial(self, worker_address: str, channel_address: str, role: str) -> None:
        loop = asyncio.get_running_loop()
        ssl_context = self.tls.ssl_context() if self.tls is not None else None
        channel: TokenChannel | None = None
        try:
            host, port = channel_address.rsplit(":", 1)
            host = host.strip("[]")
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, channel = await loop.create_connection(
                    lambda: TokenChannel(worker_address, channel_address, role), host, int(port), ssl=ssl_context,
                    server_hostname=host if ssl_context is not None else None)
                channel.hello(self.secret)
                await channel.opened
        except BaseException as exc:  # noqa: BLE001 - a half-open channel is closed whatever ended the dial
            if channel is not None:
                channel.close()
            if not isinstance(exc, Exception):  # cancelled: the worker left, or the coordinator stops
                raise
            self._failed_at[worker_address] = time.monotonic()
            logger.warning("token channel to %s worker %s (%s) failed: %s; its requests stay on gRPC calls",
                           role, worker_address, channel_address, exc or type(exc).__name__)
            return
        old = self._channels.get(worker_address)
        if old is not None:
            old.close()
        self._channels[worker_address] = channel
        for listener in self.on_open:
            listener(worker_address, channel)

    def forget(self, worker_address: str) -> None:
        """Close the channel of a worker that left (and stop dialling it)."""
        dialling = self._dialling.pop(worker_address, None)
        if dialling is not None:
            dialling.cancel()
        channel = self._channels.pop(worker_address, None)
        if channel is not None:
            channel.close()

    def lose(self, worker_address: str, reason: str) -> None:
        """The worker was declared lost: drop its channel at once, failing its requests with `reason`."""
        channel = self._channels.pop(worker_address, None)
        if channel is not None:
            channel.abort(reason)
        self.forget(worker_address)

    def close(self) -> None:
        for task in self._dialling.values():
            task.cancel()
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
