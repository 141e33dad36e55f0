"""The bench's HTTP/1.1 load generator: kept-alive connections that send a prepared request and take its streamed
answer whole, one protocol callback per socket read, parsed only once it has ended. The clients share a core with
the simulated workers; an aiohttp client there cost about as much CPU per token as the proxy under test, and a
core that the clients saturate leaves the pinned process idle, waking per read, which then counts in its figures."""

from __future__ import annotations

import asyncio
import ssl
import time
from urllib.parse import urlsplit

_TERMINAL_CHUNK = b"\r\n0\r\n\r\n"  # the end of the last data chunk, then the zero-length chunk


class StreamProtocol(asyncio.Protocol):
    """One connection; `answer` resolves to (status, body, time of the first body byte) per request."""

    def __init__(self):
        self.transport: asyncio.Transport | None = None
        self.answer: asyncio.Future | None = None
        self.closed = False
        self._reads: list[bytes] = []
        self._tail = b""
        self._first: float | None = None
        self._status = 0

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def send(self, request: bytes) -> asyncio.Future:
        self._reads, self._tail, self._first = [], b"", None
        self.answer = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.answer

    def data_received(self, data: bytes) -> None:
        if not self._reads:
            self._status = int(data[9:12])  # "HTTP/1.1 200 OK": the status line comes whole in the first read
        self._reads.append(data)
        if self._first is None:  # the first body byte, whether the head came alone or with it
            head_end = b"".join(self._reads).find(b"\r\n\r\n")
            if head_end >= 0 and sum(map(len, self._reads)) > head_end + 4:
                self._first = time.perf_counter()
        if self._status == 200:  # a stream: chunked
            self._tail = (self._tail + data)[-len(_TERMINAL_CHUNK):]
            if self._tail == _TERMINAL_CHUNK:
                self._finish(dechunk)
        elif self._error_complete():
            self._finish(lambda body: body)

    def _error_complete(self) -> bool:
        # An error has a Content-Length body: complete once that many bytes follow the head.
        head, sep, body = b"".join(self._reads).partition(b"\r\n\r\n")
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                return bool(sep) and len(body) >= int(value)
        return False

    def _finish(self, body_of) -> None:
        body = b"".join(self._reads).partition(b"\r\n\r\n")[2]
        if self.answer is not None and not self.answer.done():
            self.answer.set_result((self._status, body_of(body), self._first))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(ConnectionError(f"connection closed mid-answer: {exc}"))


def dechunk(body: bytes) -> bytes:
    """A chunked body's data."""
    data, pos = [], 0
    while True:
        line_end = body.index(b"\r\n", pos)
        size = int(body[pos:line_end].split(b";")[0], 16)
        if size == 0:
            return b"".join(data)
        data.append(body[line_end + 2:line_end + 2 + size])
        pos = line_end + 2 + size + 2


class StreamClient:
    """POSTs of one JSON body to one URL over kept-alive connections (one per request in flight)."""

    def __init__(self, base_url: str, client_ssl: ssl.SSLContext | None = None):
        url = urlsplit(base_url)
        self.host, self.port = url.hostname, url.port
        self.ssl = client_ssl if url.scheme == "https" else None
        self._idle: list[StreamProtocol] = []
        self.dialled = 0  # connections this client opened

    def request(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        return (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nAccept: */*\r\n{extra}"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body

    async def post(self, request: bytes) -> tuple[int, bytes, float]:
        """(status, body, perf_counter time of the answer's first body byte) of a prepared `request`."""
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed:
                break
        else:
            _, connection = await asyncio.get_running_loop().create_connection(
                StreamProtocol, self.host, self.port, ssl=self.ssl)
            self.dialled += 1
        answer = await connection.send(request)
        self._idle.append(connection)
        return answer

    def close(self) -> None:
        for connection in self._idle:
            connection.transport.close()
        self._idle.clear()
