"""KV caches of tensors as streams: header, checksummed blocks, trailer (framing and checks in wire.py).

Tensors travel as raw bytes (bf16 included: reinterpreted, never converted), sliced without
per-element Python work, each layer's key and value token-major ([positions, kv_heads, head_dim], the
block pool's own layout). Each block carries an xxh3-64 checksum; the receiver writes blocks straight
into its block pool's slots (or one preallocated buffer per tensor) and refuses any gap, overlap,
overrun or mismatch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import torch

from kv_transfer.base import KvLanding, KvTransferError, TransferredKv
from kv_transfer.buffer_pool import KvBufferPool
from kv_transfer.wire import (  # noqa: F401  (re-exported: the tensor path's one import site)
    DEFAULT_CHUNK_BYTES,
    ByteRuns,
    KvStreamVerifier,
    byte_blocks,
    checksum,
    header,
    item_messages,
    make_trailer,
    messages_from_items,
)
from proto import worker_pb2 as pb

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy when it is already contiguous."""
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


@dataclass(frozen=True)
class KvLayer:
    """One layer's key and value tensors, ready to send."""

    index: int
    key: torch.Tensor
    value: torch.Tensor

    def views(self) -> tuple[memoryview, memoryview]:
        return tensor_bytes(self.key), tensor_bytes(self.value)


# A KV stream before it meets a wire: a header, layers in order, a trailer.
KvItem = pb.KvHeader | KvLayer | pb.KvTrailer


def make_header(request_id: str, dtype: torch.dtype, num_layers: int, shape: tuple[int, ...],
                transfer_token: str = "", first_position: int = 0) -> pb.KvHeader:
    if dtype not in DTYPE_NAMES:
        raise KvTransferError(f"unsupported KV dtype {dtype}")
    return header(request_id, DTYPE_NAMES[dtype], num_layers, shape, transfer_token, first_position)


def kv_items(kv: TransferredKv) -> Iterator[KvItem]:
    """A whole, already computed cache as a stream of items."""
    if not kv.layers:
        raise KvTransferError("a KV cache needs at least one layer")
    key0 = kv.layers[0][0]
    yield make_header(kv.request_id, key0.dtype, len(kv.layers), tuple(key0.shape), kv.transfer_token,
                      kv.first_position)
    for i, (key, value) in enumerate(kv.layers):
        yield KvLayer(i, key, value)
    yield make_trailer(kv.first_token_id, kv.prefill_time_ms, kv.first_logprobs)


async def kv_items_async(kv: TransferredKv) -> AsyncIterator[KvItem]:
    """`kv_items` for the senders, which take item streams produced while a prefill runs."""
    for item in kv_items(kv):
        yield item


def blocks(tensor: torch.Tensor, chunk_bytes: int) -> Iterator[tuple[int, memoryview]]:
    """(offset, bytes) slices of one tensor, at most `chunk_bytes` each."""
    return byte_blocks(tensor_bytes(tensor), chunk_bytes)


def encode_kv(kv: TransferredKv, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[pb.KvMessage]:
    """A whole cache as protobuf messages: header, every block of every layer, trailer."""
    for item in kv_items(kv):
        yield from item_messages(item, chunk_bytes)


class KvAssembler(KvStreamVerifier):
    """Rebuilds a TransferredKv from a header, blocks and a trailer, refusing anything inconsistent.

    Blocks land where `landing_for(header)` says, once the header is checked: in pool blocks it hands over (a decode
    worker receiving straight into its block pool; the result then carries no tensors, only `landed`), or, where it
    hands none (or there is no `landing_for`), in one receive buffer for the whole cache, from `pool` if given.
    """

    def __init__(self, header: pb.KvHeader, max_bytes: int | None = None, pool: KvBufferPool | None = None,
                 landing_for: Callable[[pb.KvHeader], KvLanding | None] | None = None):
        super().__init__(header, max_bytes)
        self.dtype = DTYPES[header.dtype]
        self._pool = pool
        self._storage = None
        self.landing = landing_for(header) if landing_for is not None else None
        if self.landing is not None:
            self._runs = [ByteRuns(runs) for runs in self.landing.runs]
            return
        expected = self.tensor_bytes
        # One allocation for the whole cache, from the pool when there is one.
        self._storage = pool.take(self.total_bytes) if pool else torch.empty(self.total_bytes, dtype=torch.uint8)
        self._buffers = [self._storage[i * expected : (i + 1) * expected] for i in range(2 * header.num_layers)]
        self._runs = [ByteRuns([memoryview(b.numpy())]) for b in self._buffers]  # writable: blocks land in place

    def _pieces(self, index: int, offset: int, length: int) -> list[memoryview]:
        return self._runs[index].pieces(offset, length)

    def _result(self) -> TransferredKv:
        layers = []
        if self.landing is None:
            tensors = [b.view(self.dtype).reshape(self.shape) for b in self._buffers]
            layers = [(tensors[2 * i], tensors[2 * i + 1]) for i in range(self.header.num_layers)]
        return TransferredKv(
            request_id=self.header.request_id,
            layers=layers,
            first_token_id=self.trailer.first_token_id,
            prefill_time_ms=self.trailer.prefill_time_ms,
            first_logprobs=(self.trailer.first_logprob,
                            tuple((t.token_id, t.logprob) for t in self.trailer.first_top_logprobs)),
            on_release=self.discard if self._pool or self.landing else None,
            first_position=self.header.first_position,
            prompt_logprobs=list(self.trailer.prompt_logprobs) or None,
            landed=self.landing,
        )

    def discard(self) -> None:
        """Give the memory back: the pool blocks to the engine unless it took them, the buffer to the pool (after a
        failure, or once the cache has been copied out)."""
        if self.landing is not None:
            self.landing.release()
        if self._pool is not None and self._storage is not None:
            self._pool.give(self._storage)
        self._storage = None
