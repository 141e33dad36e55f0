"""The exact prefix index: which instances hold each KV block, from their KV events only (no guessing).

Every worker announces the blocks its prefix cache stores and removes (worker/service/kv_event_log.py); the
coordinator applies them here, per instance, and drops an instance's entries when it leaves, is declared lost,
or its event stream breaks. A prompt is looked up by hashing its leading blocks the way the workers do
(kv_events/block_hash.py) until no instance holds the next one, so a prompt nobody caches costs one hash.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_events.block_hash import hash_from_bytes, iter_chain_hashes
from proto import worker_pb2 as pb


@dataclass(frozen=True)
class CacheMatch:
    """Leading prompt tokens each instance holds (instances holding none left out), by role."""

    prefill: dict[str, int] = field(default_factory=dict)
    decode: dict[str, int] = field(default_factory=dict)

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
    blocks: set[int] = field(default_factory=set)
    digest: int = 0  # XOR of its block hashes: two indexes agree on an instance when block count and digest do


class KvIndex:
    """Block hash → the instances holding it (a bit per instance), built from KV event batches."""

    def __init__(self):
        self._holders: dict[int, int] = {}  # block hash -> bit mask of the slots holding it
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
        holders, blocks = self._holders, holder.blocks
        for event in batch.events:
            key = hash_from_bytes(event.hash)
            if event.removed:
                if key in blocks:
                    blocks.discard(key)
                    holder.digest ^= key
                    mask = holders[key] & ~bit
                    if mask:
                        holders[key] = mask
                    else:
                        del holders[key]
            elif key not in blocks:
                blocks.add(key)
                holder.digest ^= key
                holders[key] = holders.get(key, 0) | bit
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
        holders = self._holders
        for key in holder.blocks:
            mask = holders[key] & ~bit
            if mask:
                holders[key] = mask
            else:
                del holders[key]
        self._slots[holder.slot] = None
        mask = self._sizes[holder.block_size] & ~bit
        if mask:
            self._sizes[holder.block_size] = mask
        else:
            del self._sizes[holder.block_size]

    # lookups ---------------------------------------------------------------------------------------------
    def match(self, token_ids: list[int]) -> CacheMatch:
        """How many leading tokens of the prompt each instance holds. The last token is never counted: a worker
        always computes it (its logits give the first token)."""
        if not self._sizes:
            return NO_MATCH
        found = CacheMatch()
        holders = self._holders
        for block_size, alive in self._sizes.items():
            matched = 0
            for key in iter_chain_hashes(token_ids, block_size, num_blocks=(len(token_ids) - 1) // block_size):
                held = holders.get(key, 0) & alive
                if held != alive:
                    if matched:
                        self._credit(alive & ~held, matched * block_size, found)
                    alive = held
                    if not alive:
                        break
                matched += 1
            if alive and matched:
                self._credit(alive, matched * block_size, found)
        return found

    def _credit(self, mask: int, tokens: int, found: CacheMatch) -> None:
        slots = self._slots
        while mask:
            low = mask & -mask
            holder = slots[low.bit_length() - 1]
            found.of(holder.role)[holder.address] = tokens
            mask ^= low

    # inspection ------------------------------------------------------------------------------------------
    def blocks_of(self, address: str) -> int:
        holder = self._by_address.get(address)
        return 0 if holder is None else len(holder.blocks)

    def describe(self, address: str) -> dict | None:
        """What the index holds of `address` (for GET /v1/instances): None when it follows no events from it."""
        holder = self._by_address.get(address)
        if holder is None:
            return None
        return {"blocks": len(holder.blocks), "digest": f"{holder.digest:032x}", "epoch": holder.epoch,
                "seq": holder.seq, "block_size": holder.block_size}
