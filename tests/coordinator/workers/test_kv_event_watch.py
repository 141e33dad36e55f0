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
from tests.helpers import local_prefill_by_hand, start_sim_worker, token_channel_opens, worker_cache_view

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


async def test_the_watch_follows_a_worker_on_a_call_then_on_its_token_channel_and_forgets_it_when_taken_out():
    worker = start_sim_worker("decode", "--block-size", "4")
    address = worker.address
    client = WorkerClient()
    registry = InstanceRegistry([], [address])
    index = KvIndex()
    watch = KvEventWatch(index, client)
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
        await asyncio.sleep(0.05)
        await asyncio.to_thread(local_prefill_by_hand, address, "r3", list(range(2000, 2040)))
        assert (await converged(index, address))["blocks"] == 33

        registry.record_failure(registry.get("decode", address), "connection refused", gone=True)
        assert index.describe(address) is None and index.match(list(range(41))).decode == {}
        await asyncio.to_thread(local_prefill_by_hand, address, "r4", list(range(3000, 3040)))
        await asyncio.sleep(0.3)  # its events still come on the open channel: an evicted instance stays out
        assert index.describe(address) is None
    finally:
        await watch.stop()
        await client.close()
        worker.stop()
