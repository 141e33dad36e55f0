"""The simulated worker's KV cache: real streams (header, checksummed blocks, trailer) of synthetic bytes.

The sender's bytes are zeros sized as the configured model's cache; the receiver verifies every
block as the real one does but keeps nothing, so a simulated worker moves a real model's bytes
without holding them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer.base import KvReceipt
from kv_transfer.wire import KvStreamVerifier, RawKvLayer, header, make_trailer
from proto import worker_pb2 as pb

_zeros = memoryview(b"")


def zero_bytes(n: int) -> memoryview:
    """`n` zero bytes, views of one shared buffer (calloc'd: untouched pages cost no memory)."""
    global _zeros
    if len(_zeros) < n:
        _zeros = memoryview(bytes(max(n, 2 * len(_zeros))))
    return _zeros[:n]


def synthetic_layer(index: int, tensor_bytes: int) -> RawKvLayer:
    return RawKvLayer(index, zero_bytes(tensor_bytes), zero_bytes(tensor_bytes))


@dataclass
class VerifiedKv:
    """A KV stream that arrived whole and verified; what the simulated decode engine needs of it."""

    request_id: str
    seq_len: int
    num_bytes: int
    first_token_id: int
    prefill_time_ms: float
    receipt: KvReceipt | None = None  # set by the sink that received it
    first_position: int = 0  # positions before it were already held by the decode worker

    def release(self) -> None:
        """Nothing to give back: the bytes were never kept."""


class VerifyOnlyKvAssembler(KvStreamVerifier):
    """Receives a KV stream into scratch memory, checking every block, and keeps only its size.

    Two scratch buffers in turn: the TCP receiver reads block N+1 while block N is verified.
    """

    def __init__(self, header: pb.KvHeader, max_bytes: int | None = None, pool=None):
        super().__init__(header, max_bytes)
        self._scratch = [bytearray(), bytearray()]
        self._turn = 0
        self._reserved_views: dict[tuple[int, int], memoryview] = {}

    def _pieces(self, index: int, offset: int, length: int) -> list[memoryview]:
        self._turn ^= 1
        if len(self._scratch[self._turn]) < length:
            self._scratch[self._turn] = bytearray(length)
        view = memoryview(self._scratch[self._turn])[:length]
        self._reserved_views[(index, offset)] = view
        return [view]

    def _written(self, index: int, offset: int, length: int) -> list[memoryview]:
        return [self._reserved_views.pop((index, offset))]

    def _result(self) -> VerifiedKv:
        return VerifiedKv(self.header.request_id, self.positions, self.bytes_received, self.trailer.first_token_id,
                          self.trailer.prefill_time_ms, first_position=self.header.first_position)


class SimulatedPeerBlocks:
    """Peer pulls on a simulated worker (worker/service/kv_peer.py's PeerBlocks): synthetic bytes sized as the
    model's cache out, verified and dropped in; the pulled blocks are only bookkeeping."""

    def __init__(self, kv_shape):
        self.kv_shape = kv_shape

    def header(self, request_id: str, positions: int) -> pb.KvHeader:
        return header(request_id, self.kv_shape.dtype, self.kv_shape.num_layers, self.kv_shape.tensor_shape(positions))

    def items(self, request_id: str, block_ids: list[int], positions: int):
        yield self.header(request_id, positions)
        for i in range(self.kv_shape.num_layers):
            yield synthetic_layer(i, self.kv_shape.tensor_bytes(positions))
        yield make_trailer(0, 0.0)

    def assembler(self, kv_header: pb.KvHeader) -> VerifyOnlyKvAssembler:
        return VerifyOnlyKvAssembler(kv_header)

    def place(self, block_ids: list[int], positions: int, verified) -> None:
        pass
