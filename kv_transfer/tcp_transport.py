"""KV transfer over a raw TCP connection: the same header, blocks and trailer as the gRPC path,
framed by hand so tensor bytes go from the sender's tensors straight into the receiver's
preallocated buffers (gRPC's HTTP/2 framing caps at a quarter of a socket's speed here).

Frames, after the 6-byte preamble b"PDKV1\\n":
  b"H" u32 length, KvHeader      b"B" layer u32, is_value u8, offset u64, length u64, xxh3 u64, bytes
  b"T" u32 length, KvTrailer
The receiver answers once: status u8 (0 ok, 1 refused), bytes received u64, u32 length, message.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import AsyncIterator, Callable

from kv_transfer.base import KvTransferError, TransferredKv
from kv_transfer.codec import DEFAULT_CHUNK_BYTES, KvAssembler, KvItem, KvLayer, blocks, checksum
from proto import worker_pb2 as pb

logger = logging.getLogger(__name__)

PREAMBLE = b"PDKV1\n"
LENGTH = struct.Struct("<I")
BLOCK = struct.Struct("<IBQQQ")
ACK = struct.Struct("<BQI")


async def _recv_exactly(loop, sock: socket.socket, view: memoryview) -> None:
    while view:
        n = await loop.sock_recv_into(sock, view)
        if n == 0:
            raise KvTransferError("KV connection closed mid-stream")
        view = view[n:]


async def _recv_bytes(loop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    await _recv_exactly(loop, sock, memoryview(buf))
    return bytes(buf)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


class TcpKvSender:
    """Streams KV items to a decode worker's TCP receiver; one connection per transfer."""

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes

    async def send_items(self, address: str, items: AsyncIterator[KvItem]) -> int:
        """Send header, layers and trailer as they come; return the bytes the receiver verified."""
        loop = asyncio.get_running_loop()
        host, port = _split(address)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            try:
                await loop.sock_connect(sock, (host, port))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await loop.sock_sendall(sock, PREAMBLE)
                async for item in items:
                    await self._send_item(loop, sock, item)
                sock.shutdown(socket.SHUT_WR)
                status, received, length = ACK.unpack(await _recv_bytes(loop, sock, ACK.size))
                message = (await _recv_bytes(loop, sock, length)).decode() if length else ""
            except OSError as exc:
                raise KvTransferError(f"KV transfer to {address} failed: {exc.strerror or exc}") from exc
            except KvTransferError as exc:
                raise KvTransferError(f"KV transfer to {address} failed: {exc}") from exc
            if status != 0:
                raise KvTransferError(f"KV transfer to {address} refused: {message}")
            return received
        finally:
            sock.close()

    async def _send_item(self, loop, sock: socket.socket, item: KvItem) -> None:
        if isinstance(item, (pb.KvHeader, pb.KvTrailer)):
            body = item.SerializeToString()
            await loop.sock_sendall(sock, (b"H" if isinstance(item, pb.KvHeader) else b"T") + LENGTH.pack(len(body)) + body)
            return
        assert isinstance(item, KvLayer)
        for is_value, tensor in ((False, item.key), (True, item.value)):
            for offset, data in blocks(item.index, is_value, tensor, self.chunk_bytes):
                frame = b"B" + BLOCK.pack(item.index, int(is_value), offset, len(data), checksum(data))
                await loop.sock_sendall(sock, frame)
                await loop.sock_sendall(sock, data)

    async def send(self, address: str, kv: TransferredKv) -> int:
        from kv_transfer.codec import kv_items

        async def items():
            for item in kv_items(kv):
                yield item

        return await self.send_items(address, items())


class TcpKvReceiver:
    """Accepts KV connections, verifies every block in place, hands whole caches on."""

    def __init__(self, on_kv: Callable[[TransferredKv], None], on_failure: Callable[[str, str], None],
                 timeout_s: float = 30.0, max_bytes: int | None = None):
        self._on_kv = on_kv
        self._on_failure = on_failure
        self._timeout_s = timeout_s
        self._max_bytes = max_bytes
        self._server: socket.socket | None = None
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
            conn, _ = await loop.sock_accept(self._server)
            conn.setblocking(False)
            task = asyncio.create_task(self._serve(conn))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        seen: dict[str, str] = {}  # the request id, once the header has named it
        try:
            try:
                received = await asyncio.wait_for(self._receive(loop, conn, seen), self._timeout_s)
                reply = ACK.pack(0, received, 0)
            except (KvTransferError, asyncio.TimeoutError) as exc:
                message = str(exc) or f"KV stream did not complete within {self._timeout_s}s"
                request_id = seen.get("request_id", "")
                logger.warning("rejected KV stream for request %s: %s", request_id or "?", message)
                if request_id:
                    self._on_failure(request_id, message)
                body = message.encode()
                reply = ACK.pack(1, 0, len(body)) + body
            await loop.sock_sendall(conn, reply)
        except OSError:
            pass  # the sender is gone; it learns of the failure from its own side
        finally:
            conn.close()

    async def _receive(self, loop, conn: socket.socket, seen: dict[str, str]) -> int:
        if await _recv_bytes(loop, conn, len(PREAMBLE)) != PREAMBLE:
            raise KvTransferError("not a pdserve KV stream (bad preamble)")
        kind = await _recv_bytes(loop, conn, 1)
        if kind != b"H":
            raise KvTransferError("KV stream does not start with a header")
        header = pb.KvHeader.FromString(await _recv_bytes(loop, conn, LENGTH.unpack(await _recv_bytes(loop, conn, 4))[0]))
        seen["request_id"] = header.request_id
        assembler = KvAssembler(header, self._max_bytes)
        block_head = bytearray(BLOCK.size)
        while True:
            kind = await loop.sock_recv(conn, 1)
            if not kind:
                break
            if kind == b"B":
                await _recv_exactly(loop, conn, memoryview(block_head))
                layer, is_value, offset, length, digest = BLOCK.unpack(block_head)
                view = assembler.reserve(layer, bool(is_value), offset, length)
                await _recv_exactly(loop, conn, view)
                assembler.commit(layer, bool(is_value), offset, length, digest)
            elif kind == b"T":
                n = LENGTH.unpack(await _recv_bytes(loop, conn, 4))[0]
                assembler.set_trailer(pb.KvTrailer.FromString(await _recv_bytes(loop, conn, n)))
            else:
                raise KvTransferError(f"unknown KV frame {kind!r}")
        kv = assembler.finish()
        self._on_kv(kv)
        return assembler.bytes_received
