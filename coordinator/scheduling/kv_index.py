"""The exact prefix index: which instances hold each KV block, and where (pool or tier), from their KV events.

Every worker announces the blocks its prefix cache stores and removes (worker/service/kv_event_log.py), each
with its medium: the block pool, or the KV tier under it (local disk); the coordinator applies them here, per
instance and medium, and drops an instance's entries when it leaves, is declared lost, or its event stream
breaks. A prompt is looked up by hashing its leading blocks the way the workers do (kv_events/block_hash.py)
until no instance holds the next one, so a prompt nobody caches costs one hash.

Expected entries: a prompt just routed to an instance (`expect`) counts as held there for a short lifetime, until
the instance's events confirm its blocks, so a burst sharing a new prefix finds where the first one went. That
hashes every routed prompt whole once more (once for both of its instances).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kv_events.block_hash import hash_from_bytes, iter_chain_hashes
from proto import worker_pb2 as pb


@dataclass(frozen=True)
class CacheMatch:
    """Leading prompt tokens each instance holds (instances holding none left out), by role; of them, by address,
    those held only in its tier (`tier`) and those only expected (`expected`), where there are any."""

    prefill: dict[str, int] = field(default_factory=dict)
    decode: dict[str, int] = field(default_factory=dict)
    tier: dict[str, int] = field(default_factory=dict)
    expected: dict[str, int] = field(default_factory=dict)
    pullable: bool = True  # the prompt's blocks may be pulled between workers (its cache ids are its token ids)

    def of(self, role: str) -> dict[str, int]:
        return self.prefill if role == "prefill" else self.decode


NO_MATCH = CacheMatch()


@dataclass(eq=False)
class _Holder:
    """One instance's entries: its blocks, where its event stream stands, and an order-free digest of the blocks."""

    address: str
    role: str
    slot: int
    block_size: int
    epoch: str
    seq: int = 0
    blocks: set[int] = field(default_factory=set)  # in its pool
    tier: set[int] = field(default_factory=set)  # in its KV tier
    digest: int = 0  # XOR of its block hashes: two indexes agree on an instance when block count and digest do


class KvIndex:
    """Block hash → the instances holding it (a bit per instance), built from KV event batches."""

    def __init__(self, expected_ttl_s: float = 10.0):
        self._holders: dict[int, int] = {}  # block hash -> bit mask of the slots holding it in their pool
        self._tier_holders: dict[int, int] = {}  # the same, in their KV tier
        # block hash -> {bit of a slot a prompt holding it was just routed to: when that expires}
        self._expected: dict[int, dict[int, float]] = {}
        self._expiries: deque[tuple[float, int, int]] = deque()  # (expires, hash, bit), oldest first
        self.expected_ttl_s = expected_ttl_s
        self._by_address: dict[str, _Holder] = {}
        self._slots: list[_Holder | None] = []
        # block size -> bit mask of the instances hashing blocks of that size (usually one size for the fleet)
        self._sizes: dict[int, int] = {}

    # events ----------------------------------------------------------------------------------------------
    def apply(self, address: str, batch: pb.KvEventBatch) -> bool:
        """Apply one batch of `address`'s events; False when events were lost (a gap in the numbering, or changes
        with no snapshot before them): its entries are dropped and the subscriber must ask for a new snapshot."""
        holder = self._by_address.get(address)
        if batch.block_size <= 0:  # a broken worker's: nothing could be matched against it
            self.drop(address)
            return False
        if batch.reset:
            if holder is not None:
                self.drop(address)
            holder = self._add(address, batch)
        elif holder is None or batch.epoch != holder.epoch:
            self.drop(address)
            return False
        elif not batch.snapshot:
            if batch.seq - len(batch.events) != holder.seq:
                self.drop(address)
                return False
            holder.seq = batch.seq
        bit = 1 << holder.slot
        expected = self._expected
        for event in batch.events:
            key = hash_from_bytes(event.hash)
            if event.medium:
                holders, blocks = self._tier_holders, holder.tier
            else:
                holders, blocks = self._holders, holder.blocks
            if event.removed:
                if key in blocks:
                    blocks.discard(key)
                    holder.digest ^= key
                    _clear(holders, key, bit)
            elif key not in blocks:
                blocks.add(key)
                holder.digest ^= key
                holders[key] = holders.get(key, 0) | bit
                if key in expected:  # confirmed, if it was expected there
                    _clear_expected(expected, key, bit)
        return True

    def _add(self, address: str, batch: pb.KvEventBatch) -> _Holder:
        try:
            slot = self._slots.index(None)
        except ValueError:
            slot = len(self._slots)
            self._slots.append(None)
        holder = _Holder(address, batch.role, slot, batch.block_size, batch.epoch, batch.seq)
        self._slots[slot] = self._by_address[address] = holder
        self._sizes[holder.block_size] = self._sizes.get(holder.block_size, 0) | (1 << slot)
        return holder

    def drop(self, address: str) -> None:
        """Forget everything `address` was said to hold (it left, was lost, or its stream broke)."""
        holder = self._by_address.pop(address, None)
        if holder is None:
            return
        bit = 1 << holder.slot
        for key in holder.blocks:
            _clear(self._holders, key, bit)
        for key in holder.tier:
            _clear(self._tier_holders, key, bit)
        for key in [k for k, entry in self._expected.items() if bit in entry]:  # before its slot is reused
            _clear_expected(self._expected, key, bit)
        self._slots[holder.slot] = None
        mask = self._sizes[holder.block_size] & ~bit
        if mask:
            self._sizes[holder.block_size] = mask
        else:
            del self._sizes[holder.block_size]

    # expected entries --------------------------------------------------------------------------------------
    def expect(self, addresses: list[str], token_ids: list[int]) -> None:
        """The instances at `addresses` were just given this prompt: its blocks count as held there until their
        events confirm them or `expected_ttl_s` passes (a request that fails leaves nothing behind for longer).
        The prompt is hashed once per block size, whatever the number of instances."""
        holders = [h for h in map(self._by_address.get, addresses) if h is not None]
        if not holders or not self.expected_ttl_s:
            return
        now = time.monotonic()
        self._expire(now)
        expires, expected, expiries = now + self.expected_ttl_s, self._expected, self._expiries
        for bs in {h.block_size for h in holders}:
            same = [h for h in holders if h.block_size == bs]
            for key in iter_chain_hashes(token_ids, bs, num_blocks=(len(token_ids) - 1) // bs):
                for holder in same:
                    if key not in holder.blocks:
                        bit = 1 << holder.slot
                        expected.setdefault(key, {})[bit] = expires  # each instance's entry lives its own lifetime
                        expiries.append((expires, key, bit))

    def _expire(self, now: float) -> None:
        expiries, expected = self._expiries, self._expected
        while expiries and expiries[0][0] <= now:
            _, key, bit = expiries.popleft()
            entry = expected.get(key)
            if entry is not None and entry.get(bit, now + 1) <= now:  # not renewed since
                _clear_expected(expected, key, bit)

    # lookups ---------------------------------------------------------------------------------------------
    def match(self, token_ids: list[int]) -> CacheMatch:
        """How many leading tokens of the prompt each instance holds, in its pool, its tier or expected. The last
        token is never counted: a worker always computes it (its logits give the first token)."""
        if not self._sizes:
            return NO_MATCH
        found = CacheMatch()
        holders, tier, expected = self._holders, self._tier_holders, self._expected
        now = time.monotonic() if expected else 0.0
        for block_size, alive in self._sizes.items():
            matched = 0
            counts: dict[int, list[int]] = {}  # slot -> [tier blocks, expected blocks] in its match so far
            for key in iter_chain_hashes(token_ids, block_size, num_blocks=(len(token_ids) - 1) // block_size):
                held = holders.get(key, 0)
                in_tier = (tier.get(key, 0) & ~held) if tier else 0
                only_expected = 0
                if expected and (entry := expected.get(key)) is not None:
                    for bit, expires in entry.items():
                        if expires > now:
                            only_expected |= bit
                    only_expected &= ~held & ~in_tier
                held = (held | in_tier | only_expected) & alive
                if held != alive:
                    if matched:
                        self._credit(alive & ~held, matched * block_size, found, counts)
                    alive = held
                    if not alive:
                        break
                if in_tier or only_expected:
                    _count(in_tier & alive, counts, 0)
                    _count(only_expected & alive, counts, 1)
                matched += 1
            if alive and matched:
                self._credit(alive, matched * block_size, found, counts)
        return found

    def _credit(self, mask: int, tokens: int, found: CacheMatch, counts: dict[int, list[int]]) -> None:
        slots = self._slots
        while mask:
            low = mask & -mask
            slot = low.bit_length() - 1
            holder = slots[slot]
            found.of(holder.role)[holder.address] = tokens
            if slot in counts:
                tier_blocks, expected_blocks = counts[slot]
                if tier_blocks:
                    found.tier[holder.address] = tier_blocks * holder.block_size
                if expected_blocks:
                    found.expected[holder.address] = expected_blocks * holder.block_size
            mask ^= low

    # inspection ------------------------------------------------------------------------------------------
    def holders(self, key: int) -> list[str]:
        """The instances whose pool holds `key` (an encode worker's index: an image's content hash)."""
        mask = self._holders.get(key, 0)
        return [self._slots[slot].address for slot in range(mask.bit_length()) if mask >> slot & 1]

    def blocks_of(self, address: str, medium: str = "pool") -> int:
        holder = self._by_address.get(address)
        return 0 if holder is None else len(holder.blocks if medium == "pool" else holder.tier)

    def describe(self, address: str) -> dict | None:
        """What the index holds of `address` (for GET /v1/instances): None when it follows no events from it."""
        holder = self._by_address.get(address)
        if holder is None:
            return None
        return {"blocks": len(holder.blocks), "tier_blocks": len(holder.tier), "digest": f"{holder.digest:032x}",
                "epoch": holder.epoch, "seq": holder.seq, "block_size": holder.block_size}


def _clear(holders: dict[int, int], key: int, bit: int) -> None:
    mask = holders[key] & ~bit
    if mask:
        holders[key] = mask
    else:
        del holders[key]


def _clear_expected(expected: dict[int, dict[int, float]], key: int, bit: int) -> None:
    entry = expected[key]
    entry.pop(bit, None)
    if not entry:
        del expected[key]


def _count(mask: int, counts: dict[int, list[int]], which: int) -> None:
    while mask:
        low = mask & -mask
        counts.setdefault(low.bit_length() - 1, [0, 0])[which] += 1
        mask ^= low
