"""An aiohttp site that serves TLS with the link's current certificate on every new connection.

aiohttp's TCPSite fixes one ssl context at start; this site accepts connections itself so that
  1. each connection is wrapped with the context current when it arrives (SIGHUP reloads apply to
     new connections, connections in flight keep theirs);
  2. a client that connects and sends nothing, or never finishes its handshake, is dropped after
     `handshake_timeout_s` instead of holding a socket;
  3. plain HTTP sent to the TLS port gets a 400 saying so, in the API's error format, instead of
     a silently closed connection.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from aiohttp import web

from security.tls import LinkTls

logger = logging.getLogger(__name__)

TLS_HANDSHAKE_RECORD = 0x16  # the first byte of every TLS ClientHello


class _Listener:
    """The part of asyncio.AbstractServer that aiohttp's runner uses: `sockets` and `close()`."""

    def __init__(self, sock: socket.socket, task: asyncio.Task):
        self.sockets = [sock]
        self._task = task

    def close(self) -> None:
        self._task.cancel()
        for sock in self.sockets:
            sock.close()


class TlsSite(web.BaseSite):
    """Serve `runner`'s app over TLS on host:port; `plain_http_reply(path)` answers plain HTTP."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, tls: LinkTls,
                 plain_http_reply: Callable[[str], bytes], handshake_timeout_s: float = 10.0, backlog: int = 128):
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self._tls = tls
        self._plain_http_reply = plain_http_reply
        self._handshake_timeout_s = handshake_timeout_s
        self._pending: set[asyncio.Task] = set()

    @property
    def name(self) -> str:
        return f"https://{self._host}:{self.port}"

    @property
    def port(self) -> int:
        return self._port

    async def start(self) -> None:
        await super().start()
        family = socket.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        sock = socket.create_server((self._host, self._port), family=family, backlog=self._backlog)
        sock.setblocking(False)
        self._port = sock.getsockname()[1]
        self._server = _Listener(sock, asyncio.create_task(self._accept(sock)))

    async def stop(self) -> None:
        for task in list(self._pending):
            task.cancel()
        await super().stop()

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:  # out of file descriptors, an aborted connection: keep accepting
                logger.warning("accept on %s failed: %s", self.name, exc)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._connect(conn))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _connect(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._handshake_timeout_s):
                first = await _peek(loop, conn, 1024)
                if not first:
                    conn.close()
                    return
                if first[0] != TLS_HANDSHAKE_RECORD:
                    await self._refuse_plain_http(loop, conn, first)
                    return
                context = self._tls.ssl_context()
                await loop.connect_accepted_socket(self._runner.server, conn, ssl=context,
                                                   ssl_handshake_timeout=self._handshake_timeout_s)
        except (OSError, TimeoutError) as exc:
            # A refused certificate, a client that never finished its handshake: the peer learns from the alert.
            logger.info("TLS connection refused on %s: %s", self.name, exc or "handshake timed out")
            conn.close()
        except BaseException:
            conn.close()
            raise

    async def _refuse_plain_http(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, head: bytes) -> None:
        """Answer a plain-HTTP request with a 400 and close gently, so the client reads it (no reset)."""
        await loop.sock_sendall(conn, self._plain_http_reply(request_path(head)))
        for step in (lambda: conn.recv(65536), lambda: conn.shutdown(socket.SHUT_WR)):
            try:  # read what the client already sent: unread bytes would turn the close into a reset
                step()
            except OSError:
                pass
        conn.close()


async def _peek(loop: asyncio.AbstractEventLoop, conn: socket.socket, n: int) -> bytes:
    """The first bytes the client sent, left in the socket for the TLS layer to read."""
    conn.setblocking(False)
    while True:
        try:
            return conn.recv(n, socket.MSG_PEEK)
        except BlockingIOError:
            readable = loop.create_future()
            loop.add_reader(conn.fileno(), readable.set_result, None)
            try:
                await readable
            finally:
                loop.remove_reader(conn.fileno())


def request_path(head: bytes) -> str:
    """The path of an HTTP request line (`POST /v1/completions HTTP/1.1`), or "/"."""
    parts = head.split(b"\r\n", 1)[0].split(b" ")
    return parts[1].decode("latin-1").split("?", 1)[0] if len(parts) >= 3 else "/"
