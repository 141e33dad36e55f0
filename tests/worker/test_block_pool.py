"""The block pool's bookkeeping: reference counts, the prefix cache and its LRU eviction, without a model."""

from __future__ import annotations

import pytest

from kv_events.block_hash import ROOT_HASH, block_hash, chain_hashes
from worker.engine.block_pool import BlockPool, BlockTable


def filled(pool: BlockPool, tokens: list[int]) -> BlockTable:
    """A table holding `tokens`, computed and registered, as after a prefill."""
    table = BlockTable()
    assert pool.grow(table, len(tokens))
    pool.register(table, tokens, len(tokens))
    return table


def test_a_block_hash_depends_on_every_token_before_it():
    a = chain_hashes(list(range(48)), 16)
    b = chain_hashes([99] + list(range(1, 48)), 16)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b))  # one token changed the first block: all differ
    assert a[0] == block_hash(ROOT_HASH, list(range(16)))
    assert chain_hashes(list(range(47)), 16) == a[:2]  # only full blocks have a hash


def test_released_full_blocks_stay_cached_and_a_later_prompt_takes_them():
    pool = BlockPool(16, 4)
    first = filled(pool, list(range(10)))  # 2 full blocks + 2 tokens
    pool.release(first)
    assert pool.stats().cached_blocks == 2 and pool.num_free == 15
    table = BlockTable()
    assert pool.cached_prefix(list(range(9)) + [77], 9, table) == 8
    assert pool.stats().cached_blocks == 0  # in use again
    assert (pool.hit_tokens, pool.queried_tokens) == (8, 9)


def test_shared_blocks_are_counted_once_and_freed_when_the_last_holder_leaves():
    pool = BlockPool(16, 4)
    owner = filled(pool, list(range(8)))
    sharer = BlockTable()
    assert pool.cached_prefix(list(range(8)), 8, sharer) == 8
    assert sharer.block_ids == owner.block_ids and pool.stats().used_blocks == 2
    pool.release(owner)
    assert pool.stats().used_blocks == 2  # the sharer still holds them
    pool.release(sharer)
    assert pool.stats().used_blocks == 0 and pool.stats().cached_blocks == 2


def test_cached_blocks_are_evicted_least_recently_released_first_and_tails_before_heads():
    pool = BlockPool(5, 4)  # 4 usable blocks
    a = filled(pool, [1] * 8)
    pool.release(a)  # a's tail, then a's head, are the oldest cached
    b = filled(pool, [2] * 8)
    pool.release(b)
    grab = BlockTable()
    assert pool.grow(grab, 4)  # no free block: one eviction
    probe = BlockTable()
    assert pool.cached_prefix([1] * 8, 8, probe) == 4  # a's head survived, its tail was evicted
    pool.release(probe)
    assert pool.cached_prefix([2] * 8, 8, BlockTable()) == 8


def test_growing_past_the_free_blocks_takes_nothing_and_says_so():
    pool = BlockPool(4, 4)
    table = BlockTable()
    assert not pool.grow(table, 4 * 4)
    assert table.block_ids == [] and pool.num_free == 3


def test_the_same_contents_computed_twice_are_cached_once():
    pool = BlockPool(16, 4)
    a, b = filled(pool, list(range(8))), filled(pool, list(range(8)))
    pool.release(a)
    pool.release(b)
    assert pool.stats().cached_blocks == 2 and pool.num_free == 15


def test_with_prefix_caching_off_nothing_is_found_or_kept():
    pool = BlockPool(16, 4, prefix_caching=False)
    pool.release(filled(pool, list(range(8))))
    assert pool.cached_prefix(list(range(8)), 8, BlockTable()) == 0
    assert pool.stats().cached_blocks == 0


@pytest.mark.parametrize("blocks", [0, 1])
def test_a_pool_needs_a_block_besides_the_reserved_zero_block(blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(blocks, 16)


def test_a_table_found_partly_cached_takes_the_blocks_cached_since():
    pool = BlockPool(16, 4)
    tokens = list(range(12))
    early = BlockTable()
    assert pool.cached_prefix(tokens, 11, early) == 0  # accepted before anyone had the prompt
    pool.release(filled(pool, tokens))  # another request with the same prompt left its blocks meanwhile
    assert pool.more_cached_prefix(tokens, 11, early) == 8  # the last block holds the position it must compute
    assert pool.hit_tokens == 8 and pool.queried_tokens == 11
