"""An image's encoder output between workers, without torch: the stream an encode worker sends a prefill worker
(EncoderService.PullEmbeddings) and the puller's checks.

Life of one pull:
  1. The prefill worker asks the encode worker named in the MediaItem for the image's content hash, over the
     worker-to-worker gRPC link (its TLS and the worker secret, as KV peer pulls).
  2. The encode worker answers NOT_FOUND when its cache no longer holds it; else a header (content hash, rows,
     hidden, dtype, byte count) and the tensor's bytes in chunks, each with its xxh3-64.
  3. The puller checks the header against what it expects (the hash it asked for, the span's rows, its model's
     hidden size and dtype, MAX_EMBEDDING_BYTES) before taking any chunk, then every chunk's checksum, and the
     count at the end: anything else refuses the stream (EmbeddingsRefused, naming what did not fit).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kv_transfer.base import KvTransferError
from kv_transfer.wire import DTYPE_SIZES, checksum
from proto import worker_pb2 as pb

# One image's output: 4096 rows of a hidden size of 8192 in float32 (a large model's tiled image) is 128 MB.
MAX_EMBEDDING_BYTES = 128 * 2**20
EMBEDDING_CHUNK_BYTES = 2 * 2**20  # under gRPC's default 4 MB message limit


class EmbeddingsRefused(KvTransferError):
    """An embeddings stream that is not the tensor asked for (shape, dtype, size, checksums, order)."""


@dataclass(frozen=True)
class EmbeddingsShape:
    """What the puller's model takes for one image: [rows, hidden] of `dtype`."""

    rows: int
    hidden: int
    dtype: str

    @property
    def num_bytes(self) -> int:
        return self.rows * self.hidden * DTYPE_SIZES[self.dtype]


def embeddings_messages(content_hash: bytes, rows: int, hidden: int, dtype: str, data,
                        chunk_bytes: int = EMBEDDING_CHUNK_BYTES) -> Iterator[pb.EmbeddingsMessage]:
    """The stream of one tensor's bytes (`data`, a bytes-like object of [rows, hidden] `dtype`): header, chunks."""
    view = memoryview(data).cast("B")
    yield pb.EmbeddingsMessage(header=pb.EmbeddingsHeader(content_hash=content_hash, rows=rows, hidden=hidden,
                                                          dtype=dtype, num_bytes=len(view)))
    for start in range(0, len(view), chunk_bytes):
        piece = view[start:start + chunk_bytes]
        yield pb.EmbeddingsMessage(chunk=pb.EmbeddingsChunk(data=bytes(piece), checksum=checksum(piece)))


class EmbeddingsReceiver:
    """The puller's side of one stream: `take` each message in order, then `finish` for the tensor's bytes."""

    def __init__(self, content_hash: bytes, expected: EmbeddingsShape, where: str):
        self.content_hash = content_hash
        self.expected = expected
        self.where = where  # the item, for the error message
        self._header: pb.EmbeddingsHeader | None = None
        self._data = bytearray()

    def take(self, message: pb.EmbeddingsMessage) -> None:
        part = message.WhichOneof("part")
        if self._header is None:
            if part != "header":
                raise self._refused("the stream did not start with its header")
            self._check_header(message.header)
            self._header = message.header
            return
        if part != "chunk":
            raise self._refused("a second header came")
        chunk = message.chunk
        if checksum(chunk.data) != chunk.checksum:
            raise self._refused(f"a chunk's checksum does not match its bytes (at byte {len(self._data)})")
        if len(self._data) + len(chunk.data) > self._header.num_bytes:
            raise self._refused(f"more than the header's {self._header.num_bytes} bytes came")
        self._data += chunk.data

    def finish(self) -> bytearray:
        if self._header is None:
            raise self._refused("the stream ended before its header")
        if len(self._data) != self._header.num_bytes:
            raise self._refused(f"the stream ended after {len(self._data)} of {self._header.num_bytes} bytes")
        return self._data

    def _check_header(self, header: pb.EmbeddingsHeader) -> None:
        want = self.expected
        if header.content_hash != self.content_hash:
            raise self._refused("the header names another image")
        if header.dtype not in DTYPE_SIZES:
            raise self._refused(f"dtype {header.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        if (header.rows, header.hidden, header.dtype) != (want.rows, want.hidden, want.dtype):
            raise self._refused(f"shape [{header.rows}, {header.hidden}] of {header.dtype} does not fit this "
                                f"model, which takes [{want.rows}, {want.hidden}] of {want.dtype} for it")
        if header.num_bytes != want.num_bytes or header.num_bytes > MAX_EMBEDDING_BYTES:
            raise self._refused(f"{header.num_bytes} bytes announced for [{header.rows}, {header.hidden}] of "
                                f"{header.dtype} ({want.num_bytes} expected, at most {MAX_EMBEDDING_BYTES})")

    def _refused(self, why: str) -> EmbeddingsRefused:
        return EmbeddingsRefused(f"{self.where}: embeddings refused: {why}")
