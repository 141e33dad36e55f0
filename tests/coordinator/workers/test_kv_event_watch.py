"""The coordinator's KV event watch against a real (simulated) worker process: it follows the worker's
prefix cache on a Watch call, moves onto the token channel once one opens, falls back when it breaks,
and forgets the worker when it is taken out."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.workers.instances import InstanceRegistry
from coordinator.workers.kv_event_watch import KvEventWatch
from coordinator.scheduling.kv_index import KvIndex
from coordinator.workers.client import WorkerClient
from tests.helpers import (local_prefill_by_hand, start_sim_worker, token_channel_opens, wait_until,
                           worker_cache_view)

pytestmark = pytest.mark.system


async def converged(index: KvIndex, address: str, timeout_s: float = 10.0) -> dict:
    """Wait until the index holds of `address` what the worker itself says it holds."""
    view = None
    for _ in range(int(timeout_s / 0.1)):
        view = await asyncio.to_thread(worker_cache_view, address)
        held = index.describe(address)
        if held is not None and all(held[k] == view[k] for k in ("blocks", "digest", "epoch")):
            return held
        await asyncio.sleep(0.1)
    raise AssertionError(f"index {index.describe(address)} never matched the worker's {view}")


class Witness:
    """A second coordinator's view of a worker: its own client, registry, index and watch."""

    def __init__(self):
        self.client = WorkerClient()
        self.index = KvIndex()
        self.watch = KvEventWatch(self.index, self.client)

    def follow(self, address: str) -> None:
        self.watch.start(InstanceRegistry([], [address]))

    async def stop(self) -> None:
        await self.watch.stop()
        await self.client.close()


async def test_the_watch_follows_a_worker_on_a_call_then_on_its_token_channel_and_forgets_it_when_taken_out():
    worker = start_sim_worker("decode", "--block-size", "4")
    address = worker.address
    client = WorkerClient()
    registry = InstanceRegistry([], [address])
    index = KvIndex()
    watch = KvEventWatch(index, client)
    witness = Witness()
    try:
        watch.start(registry)
        channel_address = await asyncio.to_thread(local_prefill_by_hand, address, "r1", list(range(40)))
        held = await converged(index, address)
        assert held["blocks"] == 11 and held["block_size"] == 4  # 47 computed positions: 40 prompt + 7 of 8 generated
        assert client.token_channels.open_channel(address) is None  # so far, on the Watch call

        client.token_channels.learn(address, channel_address)
        channel = await token_channel_opens(client, address)
        for _ in range(100):
            if channel.kv_events_sink is not None:
                break
            await asyncio.sleep(0.05)
        assert channel.kv_events_sink is not None  # the channel took over
        await asyncio.to_thread(local_prefill_by_hand, address, "r2", list(range(1000, 1040)))
        assert (await converged(index, address))["blocks"] == 22
        assert index.match(list(range(1000, 1041))).decode == {address: 40}

        channel.abort("the test cut it")  # back to a Watch call, with a snapshot
        await wait_until(lambda: channel.kv_events_sink is None, what="the watch to leave the cut channel")
        await asyncio.to_thread(local_prefill_by_hand, address, "r3", list(range(2000, 2040)))
        assert (await converged(index, address))["blocks"] == 33

        registry.record_failure(registry.get("decode", address), "connection refused", gone=True)
        assert index.describe(address) is None and index.match(list(range(41))).decode == {}
        # A witness watch of its own follows the worker on: once r4's events have reached it, they were published
        # (and would have come to the evicted instance's subscription, had it been left open).
        witness.follow(address)
        assert (await converged(witness.index, address))["blocks"] == 33
        await asyncio.to_thread(local_prefill_by_hand, address, "r4", list(range(3000, 3040)))
        assert (await converged(witness.index, address))["blocks"] == 44
        assert index.describe(address) is None  # an evicted instance stays out
    finally:
        await watch.stop()
        await witness.stop()
        await client.close()
        worker.stop()
