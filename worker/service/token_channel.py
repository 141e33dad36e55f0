"""The decode worker's token channels: one raw connection per coordinator carries every token of that
coordinator's requests, one frame per event-loop turn (so one per decode step), where a gRPC stream
would cost a message and a wake-up per token on both ends.

Life of a channel:
  1. A coordinator connects (TLS as tls_config.worker_grpc, when it is on) and sends a
     TokenChannelHello with the worker secret (when one is set) within HELLO_TIMEOUT_S.
  2. The worker names the channel with a random id in its first frame (or says why it refused, and
     closes). The id is the channel's only handle: a Decode call, itself authenticated, names it.
  3. A Decode call naming the channel has its tokens queued on it; the queue is written as one frame
     when the event loop turn that filled it ends.
  4. When the connection closes, every request still bound to it fails, so the coordinator moves it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
import ssl

from proto import worker_pb2 as pb
from proto.token_channel import HELLO_TIMEOUT_S, MAX_HELLO_BYTES, FrameError, FrameReader, encode_frame
from security.secrets import SecretFile
from security.tls import LinkTls

logger = logging.getLogger(__name__)

# Tokens are tiny and the coordinator reads them as they come; this much unread means it stopped reading.
MAX_UNREAD_BYTES = 16 << 20


class ChannelState(enum.Enum):
    AWAITING_HELLO = "awaiting_hello"
    OPEN = "open"
    CLOSED = "closed"


class TokenChannel(asyncio.Protocol):
    """One coordinator's connection: the tokens of the requests bound to it, written once per loop turn."""

    def __init__(self, listener: TokenChannelListener):
        self.listener = listener
        self.state = ChannelState.AWAITING_HELLO
        self.channel_id = ""
        self.bound: set[str] = set()
        self._reader = FrameReader(MAX_HELLO_BYTES)
        self._pending: list[pb.RoutedToken] = []
        self._transport: asyncio.Transport | None = None
        self._hello_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._hello_timer = asyncio.get_running_loop().call_later(HELLO_TIMEOUT_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        if self.state is not ChannelState.AWAITING_HELLO:
            self._transport.abort()  # nothing follows the hello: a peer that sends more is not a coordinator
            return
        try:
            frames = self._reader.feed(data)
        except FrameError:
            self._transport.abort()
            return
        if frames:
            self._hello_timer.cancel()
            self._greet(frames[0])

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
        self.state = ChannelState.OPEN
        self.listener.channels[self.channel_id] = self
        self._write(pb.TokenChannelFrame(channel_id=self.channel_id))

    def _refuse(self, reason: str) -> None:
        logger.warning("token channel refused: %s", reason)
        self._write(pb.TokenChannelFrame(refused=reason))
        self._transport.close()

    def send(self, request_id: str, token: pb.TokenEvent) -> None:
        """Queue a token; the first one queued in a loop turn schedules the turn's single write."""
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(pb.RoutedToken(request_id=request_id, token=token))

    def _flush(self) -> None:
        tokens, self._pending = self._pending, []
        if self.state is not ChannelState.OPEN:
            return
        self._write(pb.TokenChannelFrame(tokens=tokens))
        if self._transport.get_write_buffer_size() > MAX_UNREAD_BYTES:
            logger.warning("token channel %s: the coordinator stopped reading; closing it", self.channel_id)
            self._transport.abort()

    def _write(self, frame: pb.TokenChannelFrame) -> None:
        self._transport.write(encode_frame(frame.SerializeToString()))

    def connection_lost(self, exc: Exception | None) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self.state = ChannelState.CLOSED
        self.listener.channels.pop(self.channel_id, None)
        for request_id in list(self.bound):
            self.listener.on_lost(request_id)
        self.bound.clear()


class TokenChannelListener:
    """Accepts coordinators' token channels; `channels` maps each open one's id to it."""

    def __init__(self, on_lost, secret: SecretFile | None = None, tls: LinkTls | None = None):
        self.on_lost = on_lost  # called with the id of each request whose channel closed under it
        self.secret = secret
        self.tls = tls
        self.channels: dict[str, TokenChannel] = {}
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int = 0) -> int:
        """Listen; returns the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: TokenChannel(self), host, port, ssl=self._ssl_context())
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

    def channel(self, channel_id: str) -> TokenChannel | None:
        channel = self.channels.get(channel_id) if channel_id else None
        return channel if channel is not None and channel.state is ChannelState.OPEN else None

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for channel in list(self.channels.values()):
                channel._transport.close()
            await self._server.wait_closed()
