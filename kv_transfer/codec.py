"""What a KV stream says, independent of the wire: header, checksummed blocks, trailer.

Tensors travel as raw bytes (bf16 included: reinterpreted, never converted), sliced without
per-element Python work. Each block carries an xxh3-64 checksum; the receiver writes blocks
into one preallocated buffer per tensor and refuses any gap, overlap, overrun or mismatch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import torch
import xxhash

from kv_transfer.base import KvTransferError, TransferredKv
from kv_transfer.buffer_pool import KvBufferPool
from proto import worker_pb2 as pb

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def checksum(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy when it is already contiguous."""
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


@dataclass(frozen=True)
class KvLayer:
    """One layer's key and value tensors, ready to send."""

    index: int
    key: torch.Tensor
    value: torch.Tensor


# A KV stream before it meets a wire: a header, layers in order, a trailer.
KvItem = pb.KvHeader | KvLayer | pb.KvTrailer


def make_header(request_id: str, dtype: torch.dtype, num_layers: int, shape: tuple[int, ...]) -> pb.KvHeader:
    if dtype not in DTYPE_NAMES:
        raise KvTransferError(f"unsupported KV dtype {dtype}")
    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return pb.KvHeader(request_id=request_id, dtype=DTYPE_NAMES[dtype], num_layers=num_layers, shape=list(shape),
                       tensor_bytes=nbytes)


def make_trailer(first_token_id: int, prefill_time_ms: float, first_logprobs: tuple | None = None) -> pb.KvTrailer:
    trailer = pb.KvTrailer(first_token_id=first_token_id, prefill_time_ms=prefill_time_ms)
    if first_logprobs is not None:
        trailer.first_logprob = first_logprobs[0]
        trailer.first_top_logprobs.extend(pb.TopLogprob(token_id=t, logprob=lp) for t, lp in first_logprobs[1])
    return trailer


def kv_items(kv: TransferredKv) -> Iterator[KvItem]:
    """A whole, already computed cache as a stream of items."""
    if not kv.layers:
        raise KvTransferError("a KV cache needs at least one layer")
    key0 = kv.layers[0][0]
    yield make_header(kv.request_id, key0.dtype, len(kv.layers), tuple(key0.shape))
    for i, (key, value) in enumerate(kv.layers):
        yield KvLayer(i, key, value)
    yield make_trailer(kv.first_token_id, kv.prefill_time_ms, kv.first_logprobs)


async def kv_items_async(kv: TransferredKv) -> AsyncIterator[KvItem]:
    """`kv_items` for the senders, which take item streams produced while a prefill runs."""
    for item in kv_items(kv):
        yield item


def blocks(tensor: torch.Tensor, chunk_bytes: int) -> Iterator[tuple[int, memoryview]]:
    """(offset, bytes) slices of one tensor, at most `chunk_bytes` each."""
    raw = tensor_bytes(tensor)
    for offset in range(0, len(raw), chunk_bytes):
        yield offset, raw[offset : offset + chunk_bytes]


def item_messages(item: KvItem, chunk_bytes: int) -> Iterator[pb.KvMessage]:
    """The protobuf messages of one item (for the gRPC path)."""
    if isinstance(item, pb.KvHeader):
        yield pb.KvMessage(header=item)
    elif isinstance(item, pb.KvTrailer):
        yield pb.KvMessage(trailer=item)
    else:
        for is_value, tensor in ((False, item.key), (True, item.value)):
            for offset, data in blocks(tensor, chunk_bytes):
                yield pb.KvMessage(block=pb.KvBlock(layer=item.index, is_value=is_value, offset=offset,
                                                    data=bytes(data), checksum=checksum(data)))


def encode_kv(kv: TransferredKv, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[pb.KvMessage]:
    """A whole cache as protobuf messages: header, every block of every layer, trailer."""
    for item in kv_items(kv):
        yield from item_messages(item, chunk_bytes)


async def messages_from_items(items: AsyncIterator[KvItem], chunk_bytes: int) -> AsyncIterator[pb.KvMessage]:
    async for item in items:
        for message in item_messages(item, chunk_bytes):
            yield message


class KvAssembler:
    """Rebuilds a TransferredKv from a header, blocks and a trailer, refusing anything inconsistent."""

    def __init__(self, header: pb.KvHeader, max_bytes: int | None = None, pool: KvBufferPool | None = None):
        if header.dtype not in DTYPES:
            raise KvTransferError(f"KV header dtype {header.dtype!r} is not one of {sorted(DTYPES)}")
        if header.num_layers <= 0 or len(header.shape) != 4 or any(d <= 0 for d in header.shape):
            raise KvTransferError(f"KV header has a bad layout: layers={header.num_layers} shape={list(header.shape)}")
        self.header = header
        self.dtype = DTYPES[header.dtype]
        self.shape = tuple(header.shape)
        expected = torch.Size(self.shape).numel() * torch.empty(0, dtype=self.dtype).element_size()
        if expected != header.tensor_bytes:
            raise KvTransferError(f"KV header tensor_bytes={header.tensor_bytes} but shape implies {expected}")
        total = 2 * header.num_layers * expected
        if max_bytes is not None and total > max_bytes:
            raise KvTransferError(f"KV cache of {total} bytes exceeds the receive limit of {max_bytes} bytes")
        self.tensor_bytes = expected
        self.trailer: pb.KvTrailer | None = None
        # One allocation for the whole cache, from the pool when there is one.
        self._pool = pool
        self._storage = pool.take(total) if pool else torch.empty(total, dtype=torch.uint8)
        self._buffers = [self._storage[i * expected : (i + 1) * expected] for i in range(2 * header.num_layers)]
        self._views = [memoryview(b.numpy()) for b in self._buffers]  # writable: blocks land in place
        self._reserved = [0] * (2 * header.num_layers)
        self._received = [0] * (2 * header.num_layers)
        self.bytes_received = 0

    def add_message(self, message: pb.KvMessage) -> None:
        """Take the next protobuf message after the header."""
        if message.HasField("block"):
            b = message.block
            self.reserve(b.layer, b.is_value, b.offset, len(b.data))[:] = b.data
            self.commit(b.layer, b.is_value, b.offset, len(b.data), b.checksum)
        elif message.HasField("trailer"):
            self.set_trailer(message.trailer)
        else:
            raise KvTransferError("KV stream carries a second header")

    def set_trailer(self, trailer: pb.KvTrailer) -> None:
        if self.trailer is not None:
            raise KvTransferError("KV stream carries a second trailer")
        self.trailer = trailer

    def reserve(self, layer: int, is_value: bool, offset: int, length: int) -> memoryview:
        """The buffer slice a block will be written into, after checking it belongs there.

        Reserving advances the expected offset, so the next block can be received while this
        one is still being verified; `finish` only trusts bytes that `commit` verified.
        """
        where = f"layer {layer} {'value' if is_value else 'key'} offset {offset}"
        if self.trailer is not None:
            raise KvTransferError("KV stream continues after its trailer")
        if not 0 <= layer < self.header.num_layers:
            raise KvTransferError(f"KV block for {where}: layer out of range [0, {self.header.num_layers})")
        if offset + length > self.tensor_bytes:
            raise KvTransferError(f"KV block for {where}: {length} bytes overrun a {self.tensor_bytes}-byte tensor")
        index = 2 * layer + int(is_value)
        if offset != self._reserved[index]:
            raise KvTransferError(f"KV block for {where}: expected offset {self._reserved[index]}")
        self._reserved[index] = offset + length
        return self._views[index][offset : offset + length]

    def commit(self, layer: int, is_value: bool, offset: int, length: int, expected_checksum: int) -> None:
        """Verify a block written into its reserved slice and count it as received."""
        index = 2 * layer + int(is_value)
        if checksum(self._views[index][offset : offset + length]) != expected_checksum:
            where = f"layer {layer} {'value' if is_value else 'key'} offset {offset}"
            raise KvTransferError(f"KV block for {where}: checksum mismatch")
        self._received[index] += length
        self.bytes_received += length

    def finish(self) -> TransferredKv:
        """Return the rebuilt cache, or raise if any tensor or the trailer is missing."""
        missing = [i for i, n in enumerate(self._received) if n != self.tensor_bytes]
        if missing:
            i = missing[0]
            raise KvTransferError(
                f"KV stream truncated: layer {i // 2} {'value' if i % 2 else 'key'} has "
                f"{self._received[i]} of {self.tensor_bytes} bytes"
            )
        if self.trailer is None:
            raise KvTransferError("KV stream truncated: it ended without its trailer")
        tensors = [b.view(self.dtype).reshape(self.shape) for b in self._buffers]
        layers = [(tensors[2 * i], tensors[2 * i + 1]) for i in range(self.header.num_layers)]
        return TransferredKv(
            request_id=self.header.request_id,
            layers=layers,
            first_token_id=self.trailer.first_token_id,
            prefill_time_ms=self.trailer.prefill_time_ms,
            first_logprobs=(self.trailer.first_logprob,
                            tuple((t.token_id, t.logprob) for t in self.trailer.first_top_logprobs)),
            on_release=self.discard if self._pool else None,
        )

    def discard(self) -> None:
        """Return the buffer to the pool (after a failure, or once the cache has been copied out)."""
        if self._pool is not None and self._storage is not None:
            self._pool.give(self._storage)
        self._storage = None

