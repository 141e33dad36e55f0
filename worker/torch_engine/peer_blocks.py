"""Peer pulls on a real worker (worker/service/kv_peer.py's PeerBlocks): pool blocks read out as a KV stream, and a
verified stream written into pool blocks."""

from __future__ import annotations

import torch

from kv_transfer.base import TransferredKv
from kv_transfer.codec import KvAssembler, KvLayer, make_header, make_trailer
from proto import worker_pb2 as pb


class TorchPeerBlocks:
    """The runner's KvCache, by blocks."""

    def __init__(self, runner):
        self.runner = runner

    def _slots(self, block_ids: list[int], positions: int) -> torch.Tensor:
        bs = self.runner.cache.block_size
        return torch.tensor([block_ids[p // bs] * bs + p % bs for p in range(positions)], dtype=torch.long)

    def header(self, request_id: str, positions: int) -> pb.KvHeader:
        keys = self.runner.cache.keys
        return make_header(request_id, keys[0].dtype, len(keys), (positions, *keys[0].shape[1:]))

    def items(self, request_id: str, block_ids: list[int], positions: int):
        cache, slots = self.runner.cache, self._slots(block_ids, positions)
        yield self.header(request_id, positions)
        for layer in range(len(cache.keys)):
            yield KvLayer(layer, *cache.read(layer, slots.to(cache.device)))
        yield make_trailer(0, 0.0)

    def assembler(self, kv_header: pb.KvHeader) -> KvAssembler:
        return KvAssembler(kv_header)

    def place(self, block_ids: list[int], positions: int, verified: TransferredKv) -> None:
        self.runner.cache.write(self._slots(block_ids, positions), verified.layers)
