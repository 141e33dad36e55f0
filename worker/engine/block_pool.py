"""Paged KV bookkeeping: a pool of fixed-size blocks, per-sequence block tables, and the prefix cache (no torch).

Every backend uses this one pool: the real engines place KV tensors at the slots it hands out; the
simulated engines only count. A block is free, in use (referenced by one or more tables), or cached:
unreferenced, but its full contents are known by their chained hash (`block_hash`), so a later
prompt with the same leading tokens takes it instead of recomputing it. Cached blocks are evicted
least recently released first, only when a free block is needed.

Block 0 is never handed out: attention reads it (zeros) wherever a padded row has no token.

A `listener` (the worker's KV event log) hears of every block the cache stores and removes, under the pool's
lock, so a snapshot (`registered_blocks`) and the changes after it never disagree.

With a KV tier attached (`attach_tier`), an evicted block's bytes go to the tier, and a prompt's lookup goes on
in the tier where the pool's blocks end: each block found there is loaded into a fresh pool block.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kv_events.block_hash import ROOT_HASH, block_hash, chain_hashes
from worker.engine.kv_tier import TIER, BlockBytes, KvTier

NULL_BLOCK = 0


@dataclass
class BlockTable:
    """One sequence's blocks in position order, and the chain hashes of its leading full blocks."""

    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # hash of block i, for the leading blocks known full

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class CacheListener(Protocol):
    """Hears of the prefix cache's changes (called with the pool's lock held: it must only record them)."""

    def stored(self, block_hash: int, parent_hash: int, num_tokens: int, medium: int = 0) -> None: ...
    def removed(self, block_hash: int, medium: int = 0) -> None: ...


@dataclass(frozen=True)
class PoolStats:
    """The pool's figures at one moment (for Health and metrics)."""

    num_blocks: int
    block_size: int
    free_blocks: int  # free or cached: what an allocation can take
    cached_blocks: int  # unreferenced blocks kept for their contents
    used_blocks: int  # referenced by a live sequence
    hit_tokens: int  # prompt tokens found cached, since start
    queried_tokens: int  # prompt tokens looked up, since start
    tier_hit_tokens: int = 0  # of the hits, loaded from the KV tier
    tier_blocks: int = 0  # blocks the KV tier holds


class BlockPool:
    """Fixed-size KV blocks with reference counts and a prefix cache; thread-safe (a decode worker pins prefixes
    from its event loop while its engine thread allocates)."""

    def __init__(self, num_blocks: int, block_size: int = 16, prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} must be >= 2 (block 0 is reserved)")
        if block_size <= 0:
            raise ValueError(f"block_size={block_size} must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._parent = [ROOT_HASH] * num_blocks  # the hash of the block before a hashed one, for its events
        self._free: deque[int] = deque(range(1, num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced hashed blocks, oldest first
        self._by_hash: dict[int, int] = {}
        self._lock = threading.Lock()
        # Blocks handed out for the first time since start, until the backend takes the list (`take_fresh`): their
        # memory was never written, and attention must not read garbage even where it masks it out.
        self._ever_used = bytearray(num_blocks)
        self._fresh: list[int] = []
        self.hit_tokens = 0
        self.queried_tokens = 0
        self.tier_hit_tokens = 0
        self._tier_loads = 0  # blocks loaded from the tier since `take_tier_loads` last took them
        self.listener: CacheListener | None = None
        self.tier: KvTier | None = None
        self._bytes: BlockBytes | None = None

    def attach_tier(self, tier: KvTier, blocks: BlockBytes) -> None:
        """Keep evicted blocks in `tier`, their bytes moved by `blocks` (the backend's pool memory)."""
        self.tier, self._bytes = tier, blocks

    # figures ---------------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (free, or cached and evictable)."""
        return len(self._free) + len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def stats(self) -> PoolStats:
        with self._lock:
            free = len(self._free) + len(self._cached)
            return PoolStats(self.num_blocks - 1, self.block_size, free, len(self._cached),
                             self.num_blocks - 1 - free, self.hit_tokens, self.queried_tokens, self.tier_hit_tokens,
                             self.tier.stats().blocks if self.tier is not None else 0)

    # prefix cache ----------------------------------------------------------------------------
    def cached_prefix(self, token_ids: Sequence[int], max_tokens: int, table: BlockTable) -> int:
        """Take the cached blocks that hold `token_ids`' leading full blocks (at most `max_tokens` positions) into
        the empty `table`; return the positions they cover (counted as hits; all of `max_tokens` as queried)."""
        if table.block_ids:
            raise ValueError("cached_prefix needs an empty block table")
        with self._lock:
            self.queried_tokens += max_tokens
        return self.more_cached_prefix(token_ids, max_tokens, table)

    def more_cached_prefix(self, token_ids: Sequence[int], max_tokens: int, table: BlockTable,
                           count_hits: bool = True) -> int:
        """`cached_prefix` continued: `table` holds only cached leading blocks (found before), and takes those that
        follow them now (cached since); return the positions it covers in all (new ones counted as hits)."""
        bs = self.block_size
        with self._lock:
            if not self.prefix_caching or len(table.hashes) != len(table.block_ids):
                return len(table.hashes) * bs
            parent = table.hashes[-1] if table.hashes else ROOT_HASH
            for b in range(len(table.block_ids), min(len(token_ids), max_tokens) // bs):
                h = block_hash(parent, token_ids[b * bs : (b + 1) * bs])
                block = self._by_hash.get(h)
                if block is None and (block := self._load_from_tier(h, parent, count_hits)) is None:
                    break
                self._take(block)
                table.block_ids.append(block)
                table.hashes.append(h)
                parent = h
                if count_hits:
                    self.hit_tokens += bs
            return len(table.block_ids) * bs

    def pin_prefix(self, token_ids: Sequence[int], max_tokens: int, table: BlockTable) -> int:
        """The leading blocks of `token_ids` the cache (or its tier) holds, taken into the empty `table` for a peer
        to read (not counted as this worker's hits); return the positions they cover."""
        return self.more_cached_prefix(token_ids, max_tokens, table, count_hits=False)


    def _load_from_tier(self, h: int, parent: int, count_hit: bool) -> int | None:
        """A free block holding the tier's copy of block `h`, now cached in the pool (`count_hit`: for one of this
        worker's prompts); None when the tier lacks it (or it is damaged) or no block is free. The pool's lock is
        held."""
        tier = self.tier
        if tier is None or not tier.holds(h) or not (self._free or self._cached):
            return None
        data = tier.load(h)  # first: a damaged copy must not cost an evicted block
        if data is None:
            return None
        block = self._allocate()
        self._bytes.write_block(block, data)
        self._written_whole(block)
        self._refs[block] = 0
        self._hash[block], self._parent[block], self._by_hash[h] = h, parent, block
        self._cached[block] = None
        if count_hit:  # not a peer's pin: this worker's own prompt
            self.tier_hit_tokens += self.block_size
            self._tier_loads += 1
        if self.listener is not None:
            self.listener.stored(h, parent, self.block_size)
        return block

    def register(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        """Record the contents of `table`'s blocks that are full and computed (positions < `num_computed`), so
        they are found by later prompts and kept cached once released."""
        start = len(table.hashes)
        if not self.prefix_caching or min(num_computed, len(token_ids)) // self.block_size <= start:
            return
        hashes = chain_hashes(token_ids[: num_computed], self.block_size, table.hashes[-1] if start else ROOT_HASH,
                              start)
        with self._lock:
            listener = self.listener
            parent = table.hashes[-1] if start else ROOT_HASH
            for block, h in zip(table.block_ids[start:], hashes):
                if h not in self._by_hash and self._hash[block] is None:
                    self._hash[block] = h
                    self._parent[block] = parent
                    self._by_hash[h] = block
                    if listener is not None:
                        listener.stored(h, parent, self.block_size)
                # else: the same contents were computed elsewhere too; this copy is freed, not cached
                parent = h
        table.hashes.extend(hashes)

    def registered_blocks(self, listener: CacheListener | None = None) -> list[tuple[int, int, int]]:
        """(hash, parent hash, medium) of every block the cache and its tier hold now; with `listener`, it hears of
        every change after this moment from now on (one atomic step: no change falls between the list and the
        first event)."""
        with self._lock:
            if listener is not None:
                self.listener = listener
            blocks = [(h, self._parent[block], 0) for h, block in self._by_hash.items()]
            if self.tier is not None:
                blocks += [(h, parent, TIER) for h, parent in self.tier.entries(listener)]
            return blocks

    def has_unregistered_full_block(self, table: BlockTable, num_computed: int) -> bool:
        """Whether `register` would record anything: a growing sequence fills a block only every block_size tokens."""
        return self.prefix_caching and num_computed // self.block_size > len(table.hashes)

    # allocation ------------------------------------------------------------------------------
    def can_grow(self, table: BlockTable, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - table.num_blocks <= self.num_free

    def grow(self, table: BlockTable, num_tokens: int, written_whole: bool = False) -> bool:
        """Give `table` blocks for `num_tokens` positions in all; False (and nothing taken) if the pool cannot.
        `written_whole`: the caller writes every position of them (a peer's pulled blocks), so none is zeroed."""
        need = self.blocks_for(num_tokens) - table.num_blocks
        if need <= 0:
            return True
        with self._lock:
            if need > len(self._free) + len(self._cached):
                return False
            for _ in range(need):
                block = self._allocate()
                if written_whole:
                    self._written_whole(block)
                table.block_ids.append(block)
        return True

    def _written_whole(self, block: int) -> None:
        if block in self._fresh:
            self._fresh.remove(block)

    def add_blocks(self, n: int) -> None:
        """Grow the pool by `n` free blocks (a pool that models memory it is not given, as the planner's)."""
        with self._lock:
            first = self.num_blocks
            self.num_blocks += n
            self._refs.extend([0] * n)
            self._hash.extend([None] * n)
            self._parent.extend([ROOT_HASH] * n)
            self._ever_used.extend(bytes(n))
            self._free.extend(range(first, first + n))

    def release(self, table: BlockTable) -> None:
        """Drop `table`'s references: blocks nobody else holds become cached (if their contents are known) or free.

        Released last block first, so a sequence's tail is evicted before its head, which others share more."""
        with self._lock:
            for block in reversed(table.block_ids):
                self._refs[block] -= 1
                if self._refs[block] == 0:
                    if self._hash[block] is not None:
                        self._cached[block] = None
                    else:
                        self._free.append(block)
        table.block_ids = []
        table.hashes = []

    def shrink(self, table: BlockTable, num_tokens: int) -> None:
        """Give back `table`'s blocks beyond the first `num_tokens` positions (a draft's rejected positions: never
        registered, so they go free, unhashed)."""
        keep = self.blocks_for(num_tokens)
        if table.num_blocks <= keep:
            return
        tail = BlockTable(table.block_ids[keep:])
        del table.block_ids[keep:]
        del table.hashes[keep:]
        self.release(tail)

    def _take(self, block: int) -> None:
        if self._refs[block] == 0:
            self._cached.pop(block, None)
        self._refs[block] += 1

    def take_fresh(self) -> list[int]:
        """The blocks handed out for the first time since the last call."""
        with self._lock:
            fresh, self._fresh = self._fresh, []
            return fresh

    def take_tier_loads(self) -> int:
        """Blocks loaded from the tier since the last call (the simulated backend charges each a load)."""
        with self._lock:
            loads, self._tier_loads = self._tier_loads, 0
            return loads

    def _allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
            if not self._ever_used[block]:
                self._ever_used[block] = 1
                self._fresh.append(block)
        else:
            block, _ = self._cached.popitem(last=False)  # evict the least recently released
            evicted = self._hash[block]
            del self._by_hash[evicted]
            self._hash[block] = None
            if self.listener is not None:
                self.listener.removed(evicted)
            if self.tier is not None and self.tier.wants(evicted):  # its bytes leave now: it is overwritten next
                self.tier.evicted(evicted, self._parent[block], self._bytes.read_block(block))
        self._refs[block] = 1
        return block
