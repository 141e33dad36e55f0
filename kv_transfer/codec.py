"""Tensor <-> protobuf chunks, with a CRC32 per chunk and full-coverage checks on receipt.

Tensors travel as raw bytes (bf16 included: reinterpreted, never converted), sliced without
per-element Python work; the receiver writes each chunk into one preallocated buffer per tensor.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import numpy as np
import torch

from kv_transfer.base import KvTransferError, TransferredKv
from proto import worker_pb2 as pb

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


def encode_header(request_id: str, dtype: torch.dtype, num_layers: int, shape: tuple[int, ...]) -> pb.KvMessage:
    """The first message of a KV stream."""
    if dtype not in DTYPE_NAMES:
        raise KvTransferError(f"unsupported KV dtype {dtype}")
    tensor_bytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return pb.KvMessage(header=pb.KvHeader(request_id=request_id, dtype=DTYPE_NAMES[dtype], num_layers=num_layers,
                                           shape=list(shape), tensor_bytes=tensor_bytes))


def encode_layer(layer: int, key: torch.Tensor, value: torch.Tensor, chunk_bytes: int) -> Iterator[pb.KvMessage]:
    """All blocks of one layer's key then value tensor."""
    yield from encode_tensor(layer, False, key, chunk_bytes)
    yield from encode_tensor(layer, True, value, chunk_bytes)


def encode_trailer(first_token_id: int, prefill_time_ms: float) -> pb.KvMessage:
    """The last message of a KV stream."""
    return pb.KvMessage(trailer=pb.KvTrailer(first_token_id=first_token_id, prefill_time_ms=prefill_time_ms))


def encode_kv(kv: TransferredKv, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[pb.KvMessage]:
    """A whole, already computed cache as one stream: header, every layer, trailer."""
    if not kv.layers:
        raise KvTransferError("a KV cache needs at least one layer")
    key0 = kv.layers[0][0]
    yield encode_header(kv.request_id, key0.dtype, len(kv.layers), tuple(key0.shape))
    for layer, (key, value) in enumerate(kv.layers):
        yield from encode_layer(layer, key, value, chunk_bytes)
    yield encode_trailer(kv.first_token_id, kv.prefill_time_ms)


def encode_tensor(layer: int, is_value: bool, tensor: torch.Tensor, chunk_bytes: int) -> Iterator[pb.KvMessage]:
    """Yield one tensor as checksummed blocks of at most `chunk_bytes`."""
    raw = _as_bytes(tensor)
    for offset in range(0, len(raw), chunk_bytes):
        data = raw[offset : offset + chunk_bytes]
        yield pb.KvMessage(
            block=pb.KvBlock(layer=layer, is_value=is_value, offset=offset, data=bytes(data), crc32=zlib.crc32(data))
        )


class KvAssembler:
    """Rebuilds a TransferredKv from a header and blocks, refusing anything inconsistent."""

    def __init__(self, header: pb.KvHeader, max_bytes: int | None = None):
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
        self._buffers = [torch.empty(expected, dtype=torch.uint8) for _ in range(2 * header.num_layers)]
        self._views = [b.numpy() for b in self._buffers]  # writable views: chunks land in place
        self._received = [0] * (2 * header.num_layers)
        self.bytes_received = 0

    def add_message(self, message: pb.KvMessage) -> None:
        """Take the next message after the header."""
        if self.trailer is not None:
            raise KvTransferError("KV stream continues after its trailer")
        if message.HasField("block"):
            self.add(message.block)
        elif message.HasField("trailer"):
            self.trailer = message.trailer
        else:
            raise KvTransferError("KV stream carries a second header")

    def add(self, block: pb.KvBlock) -> None:
        """Verify one block and copy it into place."""
        where = f"layer {block.layer} {'value' if block.is_value else 'key'} offset {block.offset}"
        if not 0 <= block.layer < self.header.num_layers:
            raise KvTransferError(f"KV block for {where}: layer out of range [0, {self.header.num_layers})")
        end = block.offset + len(block.data)
        if end > self.tensor_bytes:
            raise KvTransferError(f"KV block for {where}: {len(block.data)} bytes overrun a {self.tensor_bytes}-byte tensor")
        if zlib.crc32(block.data) != block.crc32:
            raise KvTransferError(f"KV block for {where}: checksum mismatch")
        index = 2 * block.layer + int(block.is_value)
        if block.offset != self._received[index]:
            raise KvTransferError(f"KV block for {where}: expected offset {self._received[index]}")
        self._views[index][block.offset : end] = np.frombuffer(block.data, dtype=np.uint8)
        self._received[index] = end
        self.bytes_received += len(block.data)

    def finish(self) -> TransferredKv:
        """Return the rebuilt cache, or raise if any tensor is incomplete."""
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
        )
