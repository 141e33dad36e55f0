"""Kept-alive HTTP/1.1 connections to vLLM instances on a raw asyncio protocol, each answer parsed by httptools as it
arrives (chunked transfer decoding included), so a streamed answer's pieces reach their reader inside the socket's
callback: no task wakes per read and no timer is set per read.

Life of one exchange:
  1. `HttpPool.send` takes an idle connection to the instance (dialling one when none is idle) and writes the
     request in one write;
  2. the answer's head, its body's pieces and its end go to the exchange's `AnswerReader` from `data_received`,
     and `after_read` once every piece of that socket read is handed out;
  3. at the answer's end the connection goes back to the pool when the server keeps it alive. An exchange left
     before its end (the client left, its deadline, a lost instance) closes its connection instead.
A connection idle longer than IDLE_REUSE_S is closed rather than reused: uvicorn, vLLM's server, closes idle ones
after 5 s, and a request written as it does so would fail without an answer. One that fails before any answer
byte anyway fails its reader with StaleConnection: nothing reached the server, the request may go again.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

CONNECT_TIMEOUT_S = 5.0
IDLE_REUSE_S = 4.0


class StaleConnection(ConnectionError):
    """A reused connection closed before any byte of the answer came: the server never took the request."""


class LostInstance(ConnectionError):
    """The instance was declared lost: its exchanges end at once."""


class AnswerReader:
    """Where one exchange's answer goes; every method is called from the connection's callbacks, and none raises."""

    def head(self, status: int) -> None:
        """The answer's status line and headers came."""

    def body(self, piece: bytes) -> None:
        """A piece of the body, de-chunked."""

    def end(self) -> None:
        """The whole answer came."""

    def fail(self, error: Exception) -> None:
        """The answer will not come to its end (the connection closed, or the exchange was left)."""

    def after_read(self) -> None:
        """Every piece of the socket read that brought data is handed out."""


class BodyAnswer(AnswerReader):
    """An answer read whole: `result` resolves to (status, body) at its end."""

    __slots__ = ("result", "status", "_pieces")

    def __init__(self):
        self.result = asyncio.get_running_loop().create_future()
        self.status = 0
        self._pieces: list[bytes] = []

    def head(self, status: int) -> None:
        self.status = status

    def body(self, piece: bytes) -> None:
        self._pieces.append(piece)

    def end(self) -> None:
        if not self.result.done():
            self.result.set_result((self.status, b"".join(self._pieces)))

    def fail(self, error: Exception) -> None:
        if not self.result.done():
            self.result.set_exception(error)


class HttpConnection(asyncio.Protocol):
    """One kept-alive connection to an instance, carrying one exchange at a time."""

    def __init__(self, pool: HttpPool, address: str):
        self.pool = pool
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.reader: AnswerReader | None = None
        self.reused = False  # it served an exchange before this one
        self.answered = False  # a byte of the current exchange's answer came
        self.idle_since = 0.0
        self.closed = False
        self._parser = httptools.HttpResponseParser(self)

    def start(self, request: bytes, reader: AnswerReader) -> None:
        self.reader, self.answered = reader, False
        self.transport.write(request)

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        self.answered = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:  # bytes that are not HTTP, or a reader's bug: the exchange ends
            self.abandon(ConnectionError(f"the instance's answer is not HTTP/1.1: {exc}"))
        if reader is not None:
            reader.after_read()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.discard(self)
        if self.reader is not None:
            if self.reused and not self.answered:
                error: Exception = StaleConnection("the kept-alive connection was closed before the request went")
            else:
                error = ConnectionResetError(f"the instance closed the connection{f': {exc}' if exc else ''}")
            self.abandon(error)

    # httptools' callbacks
    def on_headers_complete(self) -> None:
        if self.reader is not None:
            self.reader.head(self._parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self.reader is not None:
            self.reader.body(body)

    def on_message_complete(self) -> None:
        reader, self.reader = self.reader, None
        if reader is not None:
            reader.end()
        if self._parser.should_keep_alive() and not self.closed:
            self.pool.release(self)
        else:
            self.close()

    def abandon(self, error: Exception) -> None:
        """End the exchange under way with `error` and close the connection (its answer's rest is not wanted)."""
        reader, self.reader = self.reader, None
        self.close()
        if reader is not None:
            reader.fail(error)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool.discard(self)
            if self.transport is not None:
                self.transport.abort()


class HttpPool:
    """Kept-alive connections per instance address, dialled to its base URL (https with the context `ssl_context`
    gives when dialling: reloaded certificates apply to new connections)."""

    def __init__(self, urls: dict[str, str], ssl_context: Callable[[], ssl.SSLContext] | None = None):
        self._targets: dict[str, tuple[str, int, str]] = {}
        for address, url in urls.items():
            parts = urlsplit(url)
            default_port = 443 if parts.scheme == "https" else 80
            self._targets[address] = (parts.hostname, parts.port or default_port, parts.netloc)
        self._ssl = ssl_context
        self._idle: dict[str, list[HttpConnection]] = {}
        self._busy: dict[str, set[HttpConnection]] = {}
        self.dialled = 0  # connections opened, ever: steady load should not add to it

    def busy(self, address: str) -> int:
        """Connections to `address` carrying an exchange now."""
        return len(self._busy.get(address, ()))

    def idle(self, address: str) -> int:
        """Kept-alive connections to `address` waiting for an exchange."""
        return len(self._idle.get(address, ()))

    def host(self, address: str) -> str:
        """The Host header's value for the instance at `address`."""
        return self._target(address)[2]

    def _target(self, address: str) -> tuple[str, int, str]:
        """Where `address` is dialled: its configured URL's, else the address itself (an instance a gateway named
        to a sidecar), over TLS when the link has it."""
        target = self._targets.get(address)
        if target is None:
            host, _, port = address.rpartition(":")
            target = self._targets[address] = (host.strip("[]"), int(port), address)
        return target

    async def send(self, address: str, request: bytes, reader: AnswerReader, deadline: float) -> HttpConnection:
        """Write `request` to the instance on a kept-alive connection; its answer goes to `reader`. A dial is
        bounded by the call's `deadline` (the loop's clock: TimeoutError past it) and by CONNECT_TIMEOUT_S."""
        connection = await self._connection(address, deadline)
        self._busy.setdefault(address, set()).add(connection)
        connection.start(request, reader)
        return connection

    async def _connection(self, address: str, deadline: float) -> HttpConnection:
        idle = self._idle.get(address)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < IDLE_REUSE_S:
                connection.reused = True
                return connection
            connection.close()
        host, port, _ = self._target(address)
        loop = asyncio.get_running_loop()
        context = self._ssl() if self._ssl is not None else None
        connect_by = loop.time() + CONNECT_TIMEOUT_S
        try:
            async with asyncio.timeout_at(min(deadline, connect_by)):
                _, connection = await loop.create_connection(lambda: HttpConnection(self, address), host, port,
                                                             ssl=context, server_hostname=host if context else None)
        except TimeoutError:
            if deadline <= connect_by:
                raise  # the call's own time ran out
            # the host is gone, not the request's time
            raise ConnectionError(f"no connection to {host}:{port} within {CONNECT_TIMEOUT_S}s") from None
        self.dialled += 1
        return connection

    def release(self, connection: HttpConnection) -> None:
        busy = self._busy.get(connection.address)
        if busy is not None:
            busy.discard(connection)
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.address, []).append(connection)

    def discard(self, connection: HttpConnection) -> None:
        busy = self._busy.get(connection.address)
        if busy is not None:
            busy.discard(connection)
        idle = self._idle.get(connection.address)
        if idle and connection in idle:
            idle.remove(connection)

    def lose(self, address: str, reason: str) -> None:
        """Fail every exchange in flight to `address` with LostInstance(reason) and close its connections."""
        for connection in list(self._busy.pop(address, ())):
            connection.abandon(LostInstance(reason))
        for connection in self._idle.pop(address, []):
            connection.close()

    def close_idle(self, address: str) -> None:
        for connection in self._idle.pop(address, []):
            connection.close()

    def close(self) -> None:
        for address in list(self._targets):
            for connection in list(self._busy.get(address, ())) + self._idle.get(address, []):
                connection.close()
