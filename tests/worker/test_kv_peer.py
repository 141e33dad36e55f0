"""Peer pulls between two pools over real gRPC: the blocks arrive whole and checked, and a source that fails or
lies costs only a recompute (nothing half-written is cached)."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry, Counter

from kv_transfer.codec import KvLayer, make_header, make_trailer
from kv_transfer.grpc_transport import GRPC_OPTIONS
from kv_transfer.wire import item_messages
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from security.grpc_auth import ChannelCache
from worker.engine.block_pool import BlockPool, BlockTable
from worker.service.kv_peer import KvPeerServicer, PeerPuller
from worker.torch_engine.kv_cache import KvCache
from worker.torch_engine.peer_blocks import TorchPeerBlocks

BS = 4
PROMPT = list(range(100, 113))  # three full blocks and a token


class Metrics:
    """The two pull counters, as WorkerMetrics declares them, in a registry of their own."""

    def __init__(self):
        registry = CollectorRegistry()
        self.kv_pulls = Counter("pulls", "", ["outcome"], registry=registry)
        self.kv_pull_bytes = Counter("pull_bytes", "", ["outcome"], registry=registry)

    def count(self, outcome: str) -> float:
        return self.kv_pulls.labels(outcome)._value.get()


def worker(num_blocks=8):
    cache = KvCache(2, num_blocks, BS, 2, 8, torch.float32, torch.device("cpu"))
    for t in cache.keys + cache.values:
        t.normal_()
    runner = SimpleNamespace(cache=cache)
    return SimpleNamespace(pool=BlockPool(num_blocks, BS), peer_blocks=TorchPeerBlocks(runner), cache=cache)


def compute(w, tokens):
    table = BlockTable()
    assert w.pool.grow(table, len(tokens))
    w.pool.register(table, tokens, len(tokens) // BS * BS)
    ids = list(table.block_ids)
    w.pool.release(table)
    return ids


async def serve(servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    pb_grpc.add_KvPeerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def pull_from(servicer, puller_worker, metrics, stop_first: bool = False) -> int:
    """`puller_worker` pulls PROMPT's three blocks from a real gRPC server of `servicer` (`stop_first`: stopped
    before the pull, so nobody answers there); the positions it got."""
    server, address = await serve(servicer)
    if stop_first:
        await server.stop(None)
    channels = ChannelCache(None, GRPC_OPTIONS, grace_s=5)
    try:
        return await PeerPuller(puller_worker, channels, None, metrics, timeout_s=10).pull(request(address))
    finally:
        await channels.close()
        await server.stop(None)


def request(address, tokens=12):
    return pb.PrefillRequest(request_id="r1", prompt_token_ids=PROMPT, pull_from=address, pull_tokens=tokens)


def rows(w, block_ids, positions):
    slots = torch.tensor([block_ids[p // BS] * BS + p % BS for p in range(positions)])
    return [t[slots] for t in w.cache.keys + w.cache.values]


async def test_a_pulled_prefix_lands_in_the_pullers_cache_with_the_sources_bytes():
    source, puller_worker = worker(), worker()
    source_blocks = compute(source, PROMPT)
    metrics = Metrics()
    assert await pull_from(KvPeerServicer(source, 1024, metrics), puller_worker, metrics) == 12
    table = BlockTable()
    assert puller_worker.pool.cached_prefix(PROMPT, 12, table) == 12
    for a, b in zip(rows(puller_worker, table.block_ids, 12), rows(source, source_blocks, 12)):
        assert torch.equal(a, b)
    assert metrics.count("pulled") == 1 and metrics.count("served") == 1
    assert source.pool.stats().used_blocks == 0  # the source unpinned them


async def test_a_source_gone_costs_a_recompute_not_the_request():
    puller_worker = worker()
    metrics = Metrics()
    assert await pull_from(KvPeerServicer(worker(), 1024, metrics), puller_worker, metrics, stop_first=True) == 0
    assert metrics.count("failed") == 1
    assert puller_worker.pool.stats().cached_blocks == 0


class DyingSource(pb_grpc.KvPeerServicer):
    """A source that sends the header and one block, then fails (or sends a damaged block)."""

    def __init__(self, source, damage: bool):
        self.source, self.damage = source, damage

    async def PullKv(self, req, context):
        messages = list(self._messages(req))
        yield messages[0]
        block = messages[1]
        if self.damage:
            block.block.checksum ^= 1
            yield block
            for m in messages[2:]:
                yield m
            return
        yield block
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the source died")

    def _messages(self, req):
        table = BlockTable()
        n = self.source.pool.pin_prefix(list(req.token_ids), req.max_tokens, table)
        for item in self.source.peer_blocks.items(req.request_id, table.block_ids, n):
            yield from item_messages(item, 64)


@pytest.mark.parametrize("damage", [False, True], ids=["dies_mid_pull", "damaged_block"])
async def test_a_pull_that_breaks_mid_stream_leaves_nothing_cached(damage):
    source, puller_worker = worker(), worker()
    compute(source, PROMPT)
    metrics = Metrics()
    assert await pull_from(DyingSource(source, damage), puller_worker, metrics) == 0
    assert metrics.count("failed") == 1
    assert puller_worker.pool.cached_prefix(PROMPT, 12, BlockTable()) == 0


async def test_a_stream_in_another_layout_is_refused():
    class OtherLayout(pb_grpc.KvPeerServicer):
        async def PullKv(self, req, context):
            k = torch.zeros(12, 2, 16)  # head_dim 16, not 8
            for item in (make_header("r1", torch.float32, 2, tuple(k.shape)), KvLayer(0, k, k), KvLayer(1, k, k),
                         make_trailer(0, 0.0)):
                for m in item_messages(item, 1 << 20):
                    yield m

    metrics, puller_worker = Metrics(), worker()
    assert await pull_from(OtherLayout(), puller_worker, metrics) == 0
    assert puller_worker.pool.stats().cached_blocks == 0


async def test_a_source_holding_nothing_answers_not_found():
    metrics = Metrics()
    server, address = await serve(KvPeerServicer(worker(), 1024, metrics))
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            call = pb_grpc.KvPeerStub(channel).PullKv(pb.PullKvRequest(token_ids=PROMPT, max_tokens=12,
                                                                       block_size=BS))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await server.stop(None)
