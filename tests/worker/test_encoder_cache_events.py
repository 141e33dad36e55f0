"""An encode worker's encoder cache as KV events: one event per image stored or dropped, after a snapshot of what it
holds, so the coordinator's embeddings index knows which encode worker holds each image."""

from __future__ import annotations

import asyncio

import torch

from kv_events.block_hash import hash_from_bytes, media_content_hash
from worker.service.kv_event_log import KvEventLog
from worker.torch_engine.vision import EncoderCache

A, B, C = (media_content_hash(name) for name in (b"image-a", b"image-b", b"image-c"))


def output(rows: int, hidden: int = 4) -> torch.Tensor:
    return torch.ones(rows, hidden)


def watched(cache: EncoderCache) -> tuple[KvEventLog, list]:
    log = KvEventLog(cache, "encode", asyncio.get_running_loop())
    got: list = []
    log.subscribe(got.append)
    return log, got


def changes(batch) -> list[tuple]:
    """("stored", hash, num_tokens) or ("removed", hash) per event."""
    return [("removed", hash_from_bytes(e.hash)) if e.removed else ("stored", hash_from_bytes(e.hash), e.num_tokens)
            for e in batch.events]


async def test_a_snapshot_lists_the_images_held_then_each_image_stored_is_announced_once_with_its_rows():
    cache = EncoderCache(max_items=4)
    cache.put(A, output(3))
    log, got = watched(cache)
    assert len(got) == 1 and got[0].reset and got[0].snapshot
    assert [hash_from_bytes(e.hash) for e in got[0].events] == [A]
    cache.put(B, output(5))
    cache.put(C, output(2))
    log.publish()
    assert len(got) == 2 and not got[1].reset and not got[1].snapshot
    assert changes(got[1]) == [("stored", B, 5), ("stored", C, 2)]
    assert got[1].seq == 2 and all(not e.parent_hash and e.medium == 0 for e in got[1].events)


async def test_batches_say_role_encode_and_block_size_one():
    cache = EncoderCache(max_items=4)
    cache.put(A, output(3))
    log, got = watched(cache)
    cache.put(B, output(7))
    log.publish()
    assert [(b.role, b.block_size, b.epoch) for b in got] == [("encode", 1, log.epoch)] * 2
    assert log.block_size == 1


async def test_putting_an_image_held_already_announces_nothing():
    cache = EncoderCache(max_items=4)
    log, got = watched(cache)
    cache.put(A, output(3))
    log.publish()
    cache.put(A, output(3))  # encoded again (a race between two requests): the same image
    log.publish()
    assert [changes(b) for b in got[1:]] == [[("stored", A, 3)]] and log.seq == 1


async def test_an_image_over_the_cache_bound_drops_the_least_recently_used_and_announces_it():
    cache = EncoderCache(max_items=2)
    log, got = watched(cache)
    cache.put(A, output(1))
    cache.put(B, output(1))
    assert cache.get(A) is not None  # A is now the more recent
    cache.put(C, output(1))
    log.publish()
    assert changes(got[1]) == [("stored", A, 1), ("stored", B, 1), ("stored", C, 1), ("removed", B)]
    assert A in cache and C in cache and B not in cache
    assert [hash_from_bytes(e.hash) for e in log.snapshot()[0].events] == [A, C]


async def test_a_cache_turned_off_holds_nothing_and_announces_nothing():
    cache = EncoderCache(max_items=0)
    log, got = watched(cache)
    cache.put(A, output(3))
    log.publish()
    assert len(cache) == 0 and len(got) == 1 and log.seq == 0


def test_get_counts_hits_and_misses_and_makes_the_image_more_recent():
    cache = EncoderCache(max_items=2)
    cache.put(A, output(2))
    cache.put(B, output(2))
    assert cache.get(A) is not None and cache.get(C) is None
    assert (cache.hits, cache.misses) == (1, 1)
    cache.put(C, output(2))
    assert A in cache and B not in cache
