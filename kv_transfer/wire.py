"""A KV stream without torch: checksums, header and trailer, byte blocks, and the receiver's checks.

The real worker's tensors (codec.py) and the simulated worker's synthetic bytes go through the
same framing and the same verification; only where the bytes come from and land differs.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Protocol

import xxhash

from kv_transfer.base import KvTransferError
from proto import worker_pb2 as pb

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024

# Bytes per element of each dtype a KV stream may carry, by its wire name.
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}

# How a stream's tensors are laid out (KvHeader.kv_layout_version, Accepted/PrefillRequest.kv_layout_version): each
# layer's key and value are [positions, kv_heads, head_dim], token-major as a decode worker's block pool holds them,
# so the bytes of one pool block's positions are one run. Version 1 (sent as 0, before versions were carried) was
# head-major, [1, kv_heads, positions, head_dim]. Both ends must speak the same one.
KV_LAYOUT_VERSION = 2
KV_LAYOUTS = {0: "not set: a worker from before layout versions, head-major", 1: "head-major",
              2: "token-major per block"}


def layout_mismatch(version: int, peer: str, verb: str = "reads") -> KvTransferError | None:
    """The error refusing a transfer with `peer` ("prefill worker", "decode worker"), which uses KV layout `version`;
    None when it is this worker's."""
    if version == KV_LAYOUT_VERSION:
        return None
    known = f" ({KV_LAYOUTS[version]})" if version in KV_LAYOUTS else ""
    return KvTransferError(f"KV layout version {version}{known} from the {peer}; this worker {verb} version "
                           f"{KV_LAYOUT_VERSION} ({KV_LAYOUTS[KV_LAYOUT_VERSION]})")


def kv_tensor_shape(positions: int, kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    """One layer's key (or value) tensor on the wire: token-major, as the block pool holds it."""
    return (positions, kv_heads, head_dim)


def checksum(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def checksum_pieces(pieces: list) -> int:
    """`checksum` of the pieces' bytes one after the other (a block received over several runs of memory)."""
    if len(pieces) == 1:
        return checksum(pieces[0])
    digest = xxhash.xxh3_64()
    for piece in pieces:
        digest.update(piece)
    return digest.intdigest()


class ByteRuns:
    """One tensor's bytes laid over writable runs of memory, in order: a receive buffer is one run; a decode worker's
    block pool is a run per stretch of consecutive blocks."""

    def __init__(self, runs: list[memoryview]):
        self.runs = runs
        self._ends = list(itertools.accumulate(len(r) for r in runs))

    @property
    def nbytes(self) -> int:
        return self._ends[-1] if self._ends else 0

    def pieces(self, offset: int, length: int) -> list[memoryview]:
        """The writable pieces that bytes [offset, offset + length) of the tensor are, in order."""
        if offset + length > self.nbytes:
            raise KvTransferError(f"{length} bytes at offset {offset} overrun {self.nbytes} bytes of memory")
        pieces = []
        i = bisect.bisect_right(self._ends, offset)
        while length > 0:
            run = self.runs[i]
            start = offset - (self._ends[i] - len(run))
            take = min(length, len(run) - start)
            pieces.append(run[start : start + take])
            offset += take
            length -= take
            i += 1
        return pieces


class LayerBytes(Protocol):
    """One layer of a KV stream: its index and its key and value as raw bytes."""

    index: int

    def views(self) -> tuple[memoryview, memoryview]: ...


@dataclass(frozen=True)
class RawKvLayer:
    """A layer whose key and value are already bytes (the simulated worker's synthetic cache)."""

    index: int
    key: memoryview
    value: memoryview

    def views(self) -> tuple[memoryview, memoryview]:
        return self.key, self.value


def header(request_id: str, dtype_name: str, num_layers: int, shape: tuple[int, ...],
           transfer_token: str = "", first_position: int = 0, lora_digest: bytes = b"") -> pb.KvHeader:
    """The header of a stream of `num_layers` key/value pairs of `shape` ([positions, kv_heads, head_dim],
    `kv_tensor_shape`) in `dtype_name` (positions from `first_position` on: the decode worker holds the ones before),
    in this worker's KV layout version, carrying the decode worker's one-time `transfer_token` for the request
    (without it the stream is refused) and the LoRA adapter the cache was computed under (`lora_digest`; b"": the
    base model)."""
    if dtype_name not in DTYPE_SIZES:
        raise KvTransferError(f"unsupported KV dtype {dtype_name}")
    nbytes = math.prod(shape) * DTYPE_SIZES[dtype_name]
    return pb.KvHeader(request_id=request_id, dtype=dtype_name, num_layers=num_layers, shape=list(shape),
                       tensor_bytes=nbytes, transfer_token=transfer_token, first_position=first_position,
                       lora_digest=lora_digest, kv_layout_version=KV_LAYOUT_VERSION)


def make_trailer(first_token_id: int, prefill_time_ms: float, first_logprobs: tuple | None = None,
                 prompt_logprobs: list | None = None) -> pb.KvTrailer:
    """The stream's last message; `prompt_logprobs`: the scores of prompt tokens 1 .. n-1, when asked."""
    trailer = pb.KvTrailer(first_token_id=first_token_id, prefill_time_ms=prefill_time_ms)
    if first_logprobs is not None:
        trailer.first_logprob = first_logprobs[0]
        trailer.first_top_logprobs.extend(pb.TopLogprob(token_id=t, logprob=lp) for t, lp in first_logprobs[1])
    if prompt_logprobs:
        trailer.prompt_logprobs.extend(prompt_logprobs_to_pb(prompt_logprobs))
    return trailer


def prompt_logprobs_to_pb(entries: list) -> list[pb.PromptLogprob]:
    """Prompt tokens' scores (each with `logprob`, `rank` and `top` pairs, as a worker's TokenLogprobs) as sent."""
    return [pb.PromptLogprob(logprob=e.logprob, rank=e.rank,
                             top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in e.top]) for e in entries]


def byte_blocks(raw: memoryview, chunk_bytes: int) -> Iterator[tuple[int, memoryview]]:
    """(offset, bytes) slices of one tensor's bytes, at most `chunk_bytes` each."""
    for offset in range(0, len(raw), chunk_bytes):
        yield offset, raw[offset : offset + chunk_bytes]


def item_messages(item, chunk_bytes: int) -> Iterator[pb.KvMessage]:
    """The protobuf messages of one item: a header, a trailer, or a layer's blocks (the gRPC path)."""
    if isinstance(item, pb.KvHeader):
        yield pb.KvMessage(header=item)
    elif isinstance(item, pb.KvTrailer):
        yield pb.KvMessage(trailer=item)
    else:
        for is_value, raw in enumerate(item.views()):
            for offset, data in byte_blocks(raw, chunk_bytes):
                yield pb.KvMessage(block=pb.KvBlock(layer=item.index, is_value=bool(is_value), offset=offset,
                                                    data=bytes(data), checksum=checksum(data)))


async def messages_from_items(items: AsyncIterator, chunk_bytes: int) -> AsyncIterator[pb.KvMessage]:
    async for item in items:
        for message in item_messages(item, chunk_bytes):
            yield message


class KvStreamVerifier:
    """Checks a KV stream as it arrives: a sane header, every block in order, checksums, completeness.

    Subclasses say where a block's bytes land (`_pieces`) and what a finished stream becomes (`_result`).
    """

    def __init__(self, header: pb.KvHeader, max_bytes: int | None = None):
        mismatch = layout_mismatch(header.kv_layout_version, "prefill worker")
        if mismatch is not None:  # first: an older header's shape means something else
            raise mismatch
        if header.dtype not in DTYPE_SIZES:
            raise KvTransferError(f"KV header dtype {header.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        if header.num_layers <= 0 or len(header.shape) != 3 or any(d <= 0 for d in header.shape) \
                or header.first_position < 0:
            raise KvTransferError(f"KV header has a bad layout: layers={header.num_layers} shape={list(header.shape)} "
                                  f"first_position={header.first_position}")
        self.header = header
        self.shape = tuple(header.shape)
        expected = math.prod(self.shape) * DTYPE_SIZES[header.dtype]
        if expected != header.tensor_bytes:
            raise KvTransferError(f"KV header tensor_bytes={header.tensor_bytes} but shape implies {expected}")
        self.total_bytes = 2 * header.num_layers * expected
        if max_bytes is not None and self.total_bytes > max_bytes:
            raise KvTransferError(f"KV cache of {self.total_bytes} bytes exceeds the receive limit of {max_bytes} bytes")
        self.tensor_bytes = expected
        self.positions = self.shape[0]  # positions [first_position, first_position + positions) of the prompt
        self.trailer: pb.KvTrailer | None = None
        self._reserved = [0] * (2 * header.num_layers)
        self._received = [0] * (2 * header.num_layers)
        self.bytes_received = 0
        # Set by the sink that opens it: where the stream came in, and when (time.perf_counter).
        self.transport = ""
        self.opened_at = 0.0

    def _pieces(self, index: int, offset: int, length: int) -> list[memoryview]:
        """The writable bytes where block (`index` = 2 * layer + is_value, offset, length) goes: one piece, or
        several where the memory it lands in is not one run."""
        raise NotImplementedError

    def _written(self, index: int, offset: int, length: int) -> list[memoryview]:
        """The pieces of a reserved block once written, for its checksum."""
        return self._pieces(index, offset, length)

    def _result(self):
        """What a complete, verified stream is handed on as."""
        raise NotImplementedError

    def discard(self) -> None:
        """Give back whatever memory the stream holds (after a failure, or once it has been used)."""

    def add_message(self, message: pb.KvMessage) -> None:
        """Take the next protobuf message after the header."""
        if message.HasField("block"):
            b = message.block
            data, start = memoryview(b.data), 0
            for piece in self.reserve(b.layer, b.is_value, b.offset, len(data)):
                piece[:] = data[start : start + len(piece)]
                start += len(piece)
            self.commit(b.layer, b.is_value, b.offset, len(data), b.checksum)
        elif message.HasField("trailer"):
            self.set_trailer(message.trailer)
        else:
            raise KvTransferError("KV stream carries a second header")

    def set_trailer(self, trailer: pb.KvTrailer) -> None:
        if self.trailer is not None:
            raise KvTransferError("KV stream carries a second trailer")
        self.trailer = trailer

    def reserve(self, layer: int, is_value: bool, offset: int, length: int) -> list[memoryview]:
        """The memory a block will be written into (pieces, in order), after checking it belongs there.

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
        return self._pieces(index, offset, length)

    def commit(self, layer: int, is_value: bool, offset: int, length: int, expected_checksum: int) -> None:
        """Verify a block written into its reserved slice and count it as received."""
        index = 2 * layer + int(is_value)
        if checksum_pieces(self._written(index, offset, length)) != expected_checksum:
            where = f"layer {layer} {'value' if is_value else 'key'} offset {offset}"
            raise KvTransferError(f"KV block for {where}: checksum mismatch")
        self._received[index] += length
        self.bytes_received += length

    def finish(self):
        """Return the verified stream as `_result` makes it, or raise if any tensor or the trailer is missing."""
        missing = [i for i, n in enumerate(self._received) if n != self.tensor_bytes]
        if missing:
            i = missing[0]
            raise KvTransferError(
                f"KV stream truncated: layer {i // 2} {'value' if i % 2 else 'key'} has "
                f"{self._received[i]} of {self.tensor_bytes} bytes"
            )
        if self.trailer is None:
            raise KvTransferError("KV stream truncated: it ended without its trailer")
        return self._result()
