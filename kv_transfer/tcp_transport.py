"""KV transfer over a raw TCP connection: the same header, blocks and trailer as the gRPC path,
framed by hand so tensor bytes go from the sender's tensors straight into the receiver's memory
(its block pool, or a preallocated buffer; gRPC's HTTP/2 framing caps at a quarter of a socket's speed here).

Frames, after the 6-byte preamble b"PDKV1\\n":
  b"H" u32 length, KvHeader      b"B" layer u32, is_value u8, offset u64, length u64, bytes, xxh3 u64
  b"T" u32 length, KvTrailer
A block's checksum follows its bytes, so both sides hash on a helper thread (xxhash releases the
GIL) while the socket moves the bytes, instead of hashing and copying one after the other.
  b"E"  end of stream (TLS cannot half-close the way plain TCP's shutdown does)
The receiver answers once: status u8 (0 ok, 1 refused), bytes received u64, u32 length, message.
With tls_config.kv_transfer on, the whole exchange runs inside TLS (mutual when it says so).
A header without the request's one-time transfer token (transfer_tokens.py) is refused at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import queue
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from kv_transfer.base import KvTransferError, TransferredKv
from kv_transfer.sink import KvSink
from kv_transfer.wire import DEFAULT_CHUNK_BYTES, KvStreamVerifier, byte_blocks, checksum
from proto import worker_pb2 as pb
from security.tls import LinkTls

if TYPE_CHECKING:  # torch-backed types; this module itself stays torch-free for the simulated worker
    from kv_transfer.codec import KvItem

logger = logging.getLogger(__name__)

PREAMBLE = b"PDKV1\n"
LENGTH = struct.Struct("<I")
BLOCK = struct.Struct("<IBQQ")
DIGEST = struct.Struct("<Q")
OVERLAP_MIN_BYTES = 256 * 1024  # blocks at least this big are hashed on a helper thread
ACK = struct.Struct("<BQI")
END = b"E"
# A header is a few hundred bytes, a trailer too but for prompt logprobs (coordinator/requests/limits.py keeps them
# under about 0.75 MiB).
MAX_MESSAGE_BYTES = 1 << 20
DRAIN_MAX_S, DRAIN_MAX_BYTES = 5.0, 1 << 30  # how long and how much a refused sender may still send
MAX_RECEIVING = 64  # connections read at once, on the receiver's own threads


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


class TcpKvSender:
    """Streams KV items to a decode worker's TCP receiver; one connection per transfer.

    The socket is blocking and each item is written from a worker thread: `sendall` of a whole
    tensor then runs in C without the GIL, instead of one event-loop wakeup per socket buffer.
    """

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, io_timeout_s: float = 30.0,
                 tls: LinkTls | None = None):
        self.chunk_bytes = chunk_bytes
        self.io_timeout_s = io_timeout_s
        self.tls = tls
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-hash")
        # TLS session per receiver: a resumed handshake skips the certificate exchange and its public-key
        # work, which otherwise costs milliseconds of CPU at both ends of every transfer.
        self._sessions: dict[str, tuple[ssl.SSLContext, ssl.SSLSession]] = {}
        self.resumed = 0

    async def send_items(self, address: str, items: AsyncIterator[KvItem]) -> int:
        """Send header, layers and trailer as they come; return the bytes the receiver verified."""
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        holder: dict[str, socket.socket] = {}
        writer = asyncio.get_running_loop().run_in_executor(None, self._write_all, address, outbox, holder)
        try:
            async for item in items:
                if writer.done():
                    break
                outbox.put(item)
            outbox.put(None)
            status, received, message = await writer
        except OSError as exc:
            raise KvTransferError(f"KV transfer to {address} failed: {exc.strerror or exc}") from exc
        finally:
            outbox.put(None)
            sock = holder.get("sock")
            if sock is not None and not writer.done():
                # Unblocks the writer thread when the transfer is cancelled.
                try:
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the TCP socket, under any TLS layer
                except OSError:
                    pass
        if status != 0:
            raise KvTransferError(f"KV transfer to {address} refused: {message}")
        return received

    def _write_all(self, address: str, outbox: queue.SimpleQueue, holder: dict) -> tuple[int, int, str]:
        """On a worker thread: connect, write every queued item, read the receiver's answer."""
        host, port = _split(address)
        sock = socket.create_connection((host, port), self.io_timeout_s)
        if self.tls is not None:
            context = self.tls.ssl_context()
            kept = self._sessions.get(address)
            session = kept[1] if kept is not None and kept[0] is context else None  # none across a reload
            try:
                sock = context.wrap_socket(sock, server_hostname=host, session=session)
            except OSError:
                sock.close()
                raise
            self.resumed += sock.session_reused
        with sock:
            holder["sock"] = sock
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(PREAMBLE)
            while (item := outbox.get()) is not None:
                self._send_item(sock, item)
            ack = self._read_ack(sock)
            if self.tls is not None and sock.session is not None:
                # Read after the answer: TLS 1.3 sends its session tickets after the handshake.
                self._sessions[address] = (context, sock.session)
            return ack

    def _send_item(self, sock: socket.socket, item: KvItem) -> None:
        if isinstance(item, (pb.KvHeader, pb.KvTrailer)):
            body = item.SerializeToString()
            sock.sendall((b"H" if isinstance(item, pb.KvHeader) else b"T") + LENGTH.pack(len(body)) + body)
            return
        for is_value, raw in enumerate(item.views()):
            for offset, data in byte_blocks(raw, self.chunk_bytes):
                if len(data) < OVERLAP_MIN_BYTES:  # a thread hand-off costs more than hashing it here
                    frame = b"B" + BLOCK.pack(item.index, int(is_value), offset, len(data))
                    sock.sendall(frame + data + DIGEST.pack(checksum(data)))
                    continue
                digest = self._hasher.submit(checksum, data)
                sock.sendall(b"B" + BLOCK.pack(item.index, int(is_value), offset, len(data)))
                sock.sendall(data)
                sock.sendall(DIGEST.pack(digest.result()))

    @staticmethod
    def _read_ack(sock: socket.socket) -> tuple[int, int, str]:
        sock.sendall(END)
        status, received, length = ACK.unpack(_recv_exactly_blocking(sock, ACK.size))
        message = _recv_exactly_blocking(sock, length).decode() if length else ""
        return status, received, message

    async def send(self, address: str, kv: TransferredKv) -> int:
        """Send a computed cache; return the bytes the receiver verified."""
        from kv_transfer.codec import kv_items_async  # torch, which a caller holding tensors has loaded

        return await self.send_items(address, kv_items_async(kv))


def _recv_into_blocking(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    while view:
        if deadline is not None and time.monotonic() > deadline:
            raise KvTransferError("KV stream did not complete in time")
        n = sock.recv_into(view)
        if n == 0:
            raise KvTransferError("KV connection closed mid-stream")
        view = view[n:]


def _recv_exactly_blocking(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    _recv_into_blocking(sock, memoryview(buf), deadline)
    return bytes(buf)


def _drain(sock: socket.socket, max_s: float = DRAIN_MAX_S, max_bytes: int = DRAIN_MAX_BYTES) -> None:
    """Read and discard what a refused sender is still sending, until it closes or a bound is reached."""
    deadline = time.monotonic() + max_s
    buf = bytearray(1 << 20)
    total = 0
    sock.settimeout(0.5)
    while total < max_bytes and time.monotonic() < deadline:
        try:
            n = socket.socket.recv_into(sock, buf)  # the raw bytes, under any TLS layer: they are discarded
        except socket.timeout:
            continue
        if n == 0:
            return
        total += n


def _recv_message(sock: socket.socket, deadline: float | None) -> bytes:
    """A length-prefixed header or trailer; the length is the peer's word, so it is bounded before allocating."""
    length = LENGTH.unpack(_recv_exactly_blocking(sock, LENGTH.size, deadline))[0]
    if length > MAX_MESSAGE_BYTES:
        raise KvTransferError(f"KV header or trailer of {length} bytes exceeds {MAX_MESSAGE_BYTES}")
    return _recv_exactly_blocking(sock, length, deadline)


class TcpKvReceiver:
    """Accepts KV connections, verifies every block in place, hands whole caches to `sink`."""

    def __init__(self, sink: KvSink, timeout_s: float = 30.0, tls: LinkTls | None = None):
        self._sink = sink
        self._tls = tls
        self._timeout_s = timeout_s
        self._server: socket.socket | None = None
        self._verifier = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-verify")
        # Its own threads: a peer that connects and stalls must not hold the shared default executor.
        self._readers = ThreadPoolExecutor(max_workers=MAX_RECEIVING, thread_name_prefix="kv-recv")
        self._accept_task: asyncio.Task | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self, host: str, port: int = 0) -> int:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
        self._server = sock
        self._accept_task = asyncio.create_task(self._accept_loop())
        return sock.getsockname()[1]

    async def stop(self) -> None:
        if self._accept_task:
            self._accept_task.cancel()
        for task in list(self._connections):
            task.cancel()
        if self._server:
            self._server.close()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._server)
            except OSError as exc:  # out of file descriptors, an aborted connection: keep accepting
                logger.warning("KV receiver accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            task = asyncio.create_task(self._serve(conn))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        seen: dict = {}  # the request id and assembler, once the sink has opened the stream
        conn.setblocking(True)
        conn.settimeout(self._timeout_s)
        try:
            try:
                assembler = await loop.run_in_executor(self._readers, self._receive, conn, seen,
                                                       time.monotonic() + self._timeout_s)
                reply = ACK.pack(0, self._sink.deliver(assembler), 0)
            except (KvTransferError, OSError) as exc:
                if isinstance(exc, socket.timeout):
                    exc = KvTransferError(f"KV stream stalled: nothing arrived for {self._timeout_s}s")
                message = str(exc)
                self._sink.reject(seen.get("request_id", ""), seen.get("assembler"), message)
                body = message.encode()
                reply = ACK.pack(1, 0, len(body)) + body
            sock = seen.get("sock", conn)
            await loop.run_in_executor(self._readers, sock.sendall, reply)
            if reply[0] != 0:
                # The sender reads the answer only once it has sent everything: closing with its bytes
                # unread would reset the connection and lose the answer, so read them away for a while.
                await loop.run_in_executor(self._readers, _drain, sock)
        except OSError:
            pass  # the sender is gone; it learns of the failure from its own side
        finally:
            seen.get("sock", conn).close()

    def _receive(self, conn: socket.socket, seen: dict, deadline: float) -> KvStreamVerifier:
        """Read one whole stream on a worker thread, straight into the assembler's memory."""
        if self._tls is not None:
            # The handshake runs here, on the worker thread, bounded by the socket's timeout.
            conn = seen["sock"] = self._tls.ssl_context().wrap_socket(conn, server_side=True)
        if _recv_exactly_blocking(conn, len(PREAMBLE), deadline) != PREAMBLE:
            raise KvTransferError("not a pdserve KV stream (bad preamble)")
        if _recv_exactly_blocking(conn, 1, deadline) != b"H":
            raise KvTransferError("KV stream does not start with a header")
        header = pb.KvHeader.FromString(_recv_message(conn, deadline))
        assembler = seen["assembler"] = self._sink.open(header, "tcp")
        seen["request_id"] = header.request_id  # only now: a refused stream must not fail the request it names
        block_head = bytearray(BLOCK.size)
        digest = bytearray(DIGEST.size)
        pending = None  # the previous block's verification, running while this block arrives
        while True:  # from here the socket's timeout bounds the wait for each next block, not the whole stream
            kind = conn.recv(1)
            if kind != b"B" and pending is not None:
                pending.result()
                pending = None
            if not kind or kind == END:
                return assembler
            if kind == b"B":
                _recv_into_blocking(conn, memoryview(block_head))
                layer, is_value, offset, length = BLOCK.unpack(block_head)
                for piece in assembler.reserve(layer, bool(is_value), offset, length):
                    _recv_into_blocking(conn, piece)
                _recv_into_blocking(conn, memoryview(digest))
                if pending is not None:
                    pending.result()
                    pending = None
                args = (layer, bool(is_value), offset, length, DIGEST.unpack(digest)[0])
                if length < OVERLAP_MIN_BYTES:
                    assembler.commit(*args)
                else:
                    pending = self._verifier.submit(assembler.commit, *args)
            elif kind == b"T":
                assembler.set_trailer(pb.KvTrailer.FromString(_recv_message(conn, None)))
            else:
                raise KvTransferError(f"unknown KV frame {kind!r}")
