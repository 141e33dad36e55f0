"""A worker's KV event log: a snapshot, then every change to its prefix cache, numbered, from any thread."""

from __future__ import annotations

import asyncio
import threading

from kv_events.block_hash import ROOT_HASH, chain_hashes, hash_from_bytes
from tests.helpers import wait_until
from worker.engine.block_pool import BlockPool, BlockTable
from worker.service import kv_event_log
from worker.service.kv_event_log import KvEventLog


def fill(pool: BlockPool, tokens: list[int]) -> BlockTable:
    """A sequence of `tokens`, computed and registered (its full blocks enter the cache)."""
    table = BlockTable()
    assert pool.grow(table, len(tokens))
    pool.register(table, tokens, len(tokens))
    return table


def stored(batch) -> list[int]:
    return [hash_from_bytes(e.hash) for e in batch.events if not e.removed]


async def published(log: KvEventLog, seq: int) -> None:
    """Until the log has numbered and sent `seq` changes in all (its own count)."""
    await wait_until(lambda: log.seq == seq, what=f"the log to publish {seq} changes (at {log.seq})")


async def test_a_subscriber_gets_a_snapshot_then_each_change_numbered():
    pool = BlockPool(num_blocks=8, block_size=4)
    log = KvEventLog(pool, "decode", asyncio.get_running_loop())
    first = fill(pool, list(range(8)))
    await published(log, 2)
    got = []
    log.subscribe(got.append)
    assert len(got) == 1 and got[0].reset and got[0].snapshot and got[0].seq == 2
    assert set(stored(got[0])) == set(chain_hashes(list(range(8)), 4))
    pool.release(first)
    fill(pool, list(range(100, 128)))  # 7 blocks, all the pool has: both cached ones are evicted
    await published(log, 11)
    changes = got[1:]
    assert [(b.seq - len(b.events), b.reset, b.snapshot) for b in changes] == [(2, False, False)]
    events = changes[0].events
    assert sum(e.removed for e in events) == 2 and len(events) == 9
    new = chain_hashes(list(range(100, 128)), 4)
    assert stored(changes[0]) == new
    assert [hash_from_bytes(e.parent_hash) if e.parent_hash else ROOT_HASH for e in events if not e.removed] == \
        [ROOT_HASH, *new[:-1]]
    assert all(e.num_tokens == 4 for e in events if not e.removed)
    assert {changes[0].role, changes[0].block_size, changes[0].epoch} == {"decode", 4, log.epoch}


async def test_changes_made_on_an_engine_thread_are_published_on_the_loop():
    pool = BlockPool(num_blocks=16, block_size=4)
    log = KvEventLog(pool, "prefill", asyncio.get_running_loop())
    got = []
    log.subscribe(got.append)
    threads = [threading.Thread(target=fill, args=(pool, list(range(i * 100, i * 100 + 12)))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    await published(log, 12)
    assert sum(len(stored(b)) for b in got[1:]) == 12 and got[-1].seq == 12


async def test_a_watch_stream_too_far_behind_gets_a_snapshot_instead_of_its_backlog(monkeypatch):
    monkeypatch.setattr(kv_event_log, "MAX_BEHIND_BATCHES", 3)
    pool = BlockPool(num_blocks=64, block_size=4)
    log = KvEventLog(pool, "prefill", asyncio.get_running_loop())
    stream = log.watch()
    assert (await anext(stream)).reset
    for i in range(5):  # five batches the stream does not read
        fill(pool, list(range(i * 100, i * 100 + 4)))
        log.publish()
    batch = await anext(stream)  # the fourth overflowed the backlog: a snapshot taken when the stream reads again
    assert batch.reset and batch.seq == 5 and len(batch.events) == 5
    fill(pool, [7, 7, 7, 7])
    log.publish()
    assert (await anext(stream)).seq == 6
    await stream.aclose()


async def test_closing_the_log_ends_its_watch_streams_and_refuses_new_ones():
    pool = BlockPool(num_blocks=8, block_size=4)
    log = KvEventLog(pool, "decode", asyncio.get_running_loop())
    stream = log.watch()
    assert (await anext(stream)).reset
    log.close()
    assert [b async for b in stream] == []
    assert [b async for b in log.watch()] == []
