"""KV transfer over gRPC: a client-streaming sender on the prefill side, a servicer on the decode side."""

from __future__ import annotations

import asyncio

import grpc

from kv_transfer.base import KvStreamRefused, KvTransferError, TransferredKv
from kv_transfer.sink import KvSink
from kv_transfer.wire import DEFAULT_CHUNK_BYTES, messages_from_items
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from security.grpc_auth import ChannelCache
from security.tls import LinkTls

# Chunks are bounded, but headers and framing need headroom above the chunk size.
GRPC_MESSAGE_LIMIT = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT),
    ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT),
    # Large HTTP/2 frames and write buffers: +30-50% on multi-MiB KV blocks (bench/kv_transfer.py).
    ("grpc.http2.max_frame_size", 16 * 1024 * 1024 - 1),
    ("grpc.http2.write_buffer_size", GRPC_MESSAGE_LIMIT),
    # Keepalive on every worker link, both ends: a peer gone silent (frozen, its link cut) fails the
    # connection's calls within KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS instead of at TCP's retransmission limit.
    # The receiving end must allow pings this often, or it answers them with GOAWAY (too_many_pings).
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 4000),
    # Nor count a ping that comes early (a call waiting long in a worker's queue, BDP probes) as a strike toward
    # that GOAWAY: it would cut every call on the connection.
    ("grpc.http2.max_ping_strikes", 0),
]


class GrpcKvSender:
    """Pushes KV caches to decode workers, one cached channel per address."""

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout_s: float = 30.0, tls: LinkTls | None = None):
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        # Other workers' gRPC ports: tls_config.worker_grpc, client side. A push lasts at most timeout_s. Peer pulls
        # (worker/service/kv_peer.py) dial the same workers on these channels.
        self.channels = ChannelCache(tls, GRPC_OPTIONS, grace_s=timeout_s + 5)

    def _stub(self, address: str) -> pb_grpc.KvReceiverStub:
        return pb_grpc.KvReceiverStub(self.channels.get(address))

    async def send(self, address: str, kv: TransferredKv) -> int:
        """Stream a computed cache to `address`; return the bytes the receiver verified."""
        from kv_transfer.codec import kv_items_async  # torch, which a caller holding tensors has loaded

        return await self.send_items(address, kv_items_async(kv))

    async def send_items(self, address: str, items) -> int:
        """Stream KV items (header, layers, trailer) as they are produced."""
        return await self.send_stream(address, messages_from_items(items, self.chunk_bytes))

    async def send_stream(self, address: str, messages) -> int:
        """Stream KV messages (an iterator or async iterator, header first) to `address`."""
        try:
            ack = await self._stub(address).PushKv(messages, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise KvTransferError(f"KV transfer to {address} failed: {exc.code().name}: {exc.details()}") from exc
        return ack.bytes_received

    async def close(self) -> None:
        await self.channels.close()


class KvReceiverServicer(pb_grpc.KvReceiverServicer):
    """Verifies an incoming KV stream block by block and hands the whole cache to `sink`."""

    def __init__(self, sink: KvSink):
        self._sink = sink

    async def PushKv(self, request_iterator, context: grpc.aio.ServicerContext) -> pb.KvAck:
        request_id = ""
        verifier = None
        try:
            async for message in request_iterator:
                if verifier is not None:
                    verifier.add_message(message)
                elif message.HasField("header"):
                    verifier = await self._open(message.header)
                    request_id = message.header.request_id  # only now: a refused stream must not fail it
                else:
                    raise KvTransferError("KV stream does not start with a header")
            if verifier is None:
                raise KvTransferError("KV stream is empty")
            return pb.KvAck(bytes_received=self._sink.deliver(verifier))
        except KvTransferError as exc:
            self._sink.reject(request_id, verifier, str(exc))
            code = grpc.StatusCode.PERMISSION_DENIED if isinstance(exc, KvStreamRefused) else grpc.StatusCode.DATA_LOSS
            await context.abort(code, str(exc))

    async def _open(self, header: pb.KvHeader):
        """The sink's verifier for the stream, opened on a thread as the TCP receiver's are: a decode engine may take
        pool blocks for it, which waits for its engine thread. Should this call be cancelled meanwhile, whatever the
        verifier took is given back."""
        opening = asyncio.get_running_loop().run_in_executor(None, self._sink.open, header, "grpc")
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(_discard_opened)
            raise


def _discard_opened(opening: asyncio.Future) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result().discard()
