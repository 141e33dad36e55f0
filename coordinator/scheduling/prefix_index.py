"""Which prefill instance most recently served each prompt prefix, for cache affinity."""

from __future__ import annotations

from collections import OrderedDict


class PrefixIndex:
    """Chained hashes of a prompt's leading token blocks, each mapped to its last prefill instance.

    Block i's key hashes blocks 0..i, so a hit on block i means the whole prefix up to it is shared.
    Least recently used keys go first once `max_entries` is reached.
    """

    def __init__(self, block_tokens: int = 16, max_entries: int = 200_000):
        self.block_tokens = block_tokens
        self.max_entries = max_entries
        self._owner: OrderedDict[int, str] = OrderedDict()

    def _keys(self, token_ids: list[int]) -> list[int]:
        keys, running = [], 0
        for start in range(0, len(token_ids) - self.block_tokens + 1, self.block_tokens):
            running = hash((running, tuple(token_ids[start:start + self.block_tokens])))
            keys.append(running)
        return keys

    def longest_match(self, token_ids: list[int]) -> tuple[str | None, int]:
        """The instance that last served the longest known prefix, and that prefix's length in tokens."""
        owner, matched = None, 0
        for i, key in enumerate(self._keys(token_ids)):
            found = self._owner.get(key)
            if found is None:
                break
            owner, matched = found, (i + 1) * self.block_tokens
        return owner, matched

    def record(self, token_ids: list[int], address: str) -> None:
        for key in self._keys(token_ids):
            self._owner[key] = address
            self._owner.move_to_end(key)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)

    def forget(self, address: str) -> None:
        """Drop an instance that left: its cache is gone."""
        for key in [k for k, owner in self._owner.items() if owner == address]:
            del self._owner[key]
