"""The KV tier under a block pool: evicted blocks kept on disk, loaded back checked, and off on disk errors."""

from __future__ import annotations

import os

import pytest
import torch

from worker.engine.block_pool import BlockPool, BlockTable
from worker.engine.kv_tier import TIER, EmptyBlocks, KvTier
from worker.torch_engine.kv_cache import KvCache

BS = 4


class Events:
    def __init__(self):
        self.log = []

    def stored(self, block_hash, parent_hash, num_tokens, medium=0):
        self.log.append(("stored", block_hash, medium))

    def removed(self, block_hash, medium=0):
        self.log.append(("removed", block_hash, medium))


def pool_with_tier(tmp_path, num_blocks=4, tier_blocks=8):
    cache = KvCache(2, num_blocks, BS, 2, 8, torch.float32, torch.device("cpu"))
    for t in cache.keys + cache.values:
        t.normal_()
    pool = BlockPool(num_blocks, BS)
    tier = KvTier(tmp_path, tier_blocks, cache.block_bytes, BS)
    pool.attach_tier(tier, cache)
    events = Events()
    pool.registered_blocks(events)
    return pool, tier, cache, events


def compute(pool, tokens):
    """A prompt's blocks taken, 'computed' (registered) and released: cached in the pool."""
    table = BlockTable()
    assert pool.grow(table, len(tokens))
    pool.register(table, tokens, len(tokens))
    ids = list(table.block_ids)
    pool.release(table)
    return ids


def block_data(cache, block):
    return [t[block * BS:(block + 1) * BS].clone() for t in cache.keys + cache.values]


def test_an_evicted_block_is_kept_in_the_tier_and_loaded_back_with_its_bytes(tmp_path):
    pool, tier, cache, events = pool_with_tier(tmp_path)
    prompt = list(range(100, 108))  # two full blocks
    first = compute(pool, prompt)
    original = [block_data(cache, b) for b in first]
    compute(pool, list(range(200, 212)))  # three blocks: evicts both of the first prompt's
    tier.flush()
    assert tier.stats().blocks == 2
    assert [e for e in events.log if e[2] == TIER and e[0] == "stored"]  # announced as tier blocks

    table = BlockTable()
    assert pool.cached_prefix(prompt + [1], 8, table) == 8
    assert pool.stats().tier_hit_tokens == 8
    for block, want in zip(table.block_ids, original):
        assert all(torch.equal(a, b) for a, b in zip(block_data(cache, block), want))
    assert pool.take_fresh() == [] or not set(pool.take_fresh()) & set(table.block_ids)


def test_a_damaged_tier_block_is_dropped_and_recomputed_never_served(tmp_path):
    pool, tier, cache, events = pool_with_tier(tmp_path)
    prompt = list(range(100, 108))
    compute(pool, prompt)
    compute(pool, list(range(200, 212)))
    tier.flush()
    with open(tier.path, "r+b") as f:  # every slot's first bytes overwritten
        for slot in range(tier.capacity_blocks):
            f.seek(slot * tier.block_bytes)
            f.write(b"\xff" * 16)
    table = BlockTable()
    assert pool.cached_prefix(prompt + [1], 8, table) == 0
    assert tier.stats().dropped_blocks == 1
    assert ("removed", events.log[-1][1], TIER) == events.log[-1]


def test_a_failing_disk_turns_the_tier_off_and_the_pool_goes_on(tmp_path):
    pool, tier, cache, events = pool_with_tier(tmp_path)
    compute(pool, list(range(100, 108)))
    compute(pool, list(range(200, 212)))
    tier.flush()
    assert tier.stats().blocks == 2
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, tier._fd)  # the tier's file now answers every write with ENOSPC
    os.close(full)
    compute(pool, list(range(300, 312)))  # evicts blocks: their writes fail
    tier.flush()
    stats = tier.stats()
    assert not stats.enabled and stats.blocks == 0
    assert sum(1 for e in events.log if e[0] == "removed" and e[2] == TIER) == 2
    table = BlockTable()
    assert pool.cached_prefix(list(range(100, 109)), 8, table) == 0  # recomputed from the pool alone
    assert pool.grow(table, 8)


def test_a_tier_the_disk_cannot_hold_is_off_from_the_start(tmp_path):
    tier = KvTier(tmp_path, 1 << 40, 1 << 20, BS)  # an exabyte
    assert not tier.stats().enabled
    assert not list(tmp_path.glob("*.tier"))  # the file it could not make whole is gone
    tier.close()


def test_the_tier_evicts_its_least_recently_used_block_when_full():
    tier = KvTier(None, 2, 0, BS)
    events = Events()
    tier.entries(events)
    for h in (1, 2, 3):
        tier.evicted(h, 0, b"")
        tier.flush()
        if h == 2:
            assert tier.load(1) == b""  # 1 used again: 2 is now the least recently used
    assert [h for h, _ in tier.entries()] == [1, 3]
    assert ("removed", 2, TIER) in events.log


def test_a_simulated_tier_keeps_bookkeeping_only_and_counts_loads(tmp_path):
    pool = BlockPool(3, BS)
    tier = KvTier(None, 4, 0, BS)
    pool.attach_tier(tier, EmptyBlocks())
    compute(pool, list(range(100, 108)))
    compute(pool, list(range(200, 208)))
    tier.flush()
    assert tier.path is None and tier.stats().blocks == 2
    assert pool.cached_prefix(list(range(100, 109)), 8, BlockTable()) == 8
    assert pool.take_tier_loads() == 2 and pool.take_tier_loads() == 0


def test_the_snapshot_lists_tier_blocks_with_their_medium(tmp_path):
    pool, tier, cache, events = pool_with_tier(tmp_path)
    compute(pool, list(range(100, 108)))
    compute(pool, list(range(200, 212)))
    tier.flush()
    media = sorted(m for _, _, m in pool.registered_blocks())
    assert media == [0, 0, 0, TIER, TIER]


def test_tier_options_are_checked(tmp_path):
    from worker.service.options import ModelBackend, WorkerOptions

    with pytest.raises(ValueError, match="--kv-tier-gb needs --kv-tier-dir"):
        WorkerOptions(role="prefill", backend=ModelBackend("m"), kv_tier_gb=1)
    with pytest.raises(ValueError, match="--kv-tier-gb must be >= 0"):
        WorkerOptions(role="prefill", backend=ModelBackend("m"), kv_tier_gb=-1, kv_tier_dir=str(tmp_path))
    with pytest.raises(ValueError, match="no-prefix-caching"):
        WorkerOptions(role="prefill", backend=ModelBackend("m"), kv_tier_gb=1, kv_tier_dir=str(tmp_path),
                      prefix_caching=False)


def test_a_block_whose_slot_the_writer_reuses_during_a_read_is_a_miss_not_damage(tmp_path, monkeypatch):
    tier = KvTier(tmp_path, 1, 64, BS)  # one slot: the next block written takes it
    tier.evicted(1, 0, bytearray(b"a" * 64))
    tier.flush()
    read = os.preadv

    def read_while_the_writer_takes_the_slot(fd, buffers, offset):
        monkeypatch.setattr(os, "preadv", read)
        tier._write(2, 0, bytearray(b"b" * 64))  # the tier is full: block 1 is dropped and its slot reused
        return read(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", read_while_the_writer_takes_the_slot)
    assert tier.load(1) is None
    stats = tier.stats()
    assert stats.dropped_blocks == 0 and [h for h, _ in tier.entries()] == [2]
    assert tier.load(2) == bytearray(b"b" * 64)
    tier.close()
