"""The identity of a full KV block: a hash chained over its tokens and every block before it (no torch).

Two blocks share a hash only if the whole prefix up to their end is the same tokens, so a hit on
block i is a hit on blocks 0..i. `extra` folds in anything else that changes the block's KV (later:
the identity of an image); the model and dtype are a worker's own and need not be hashed.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

ROOT_HASH = 0  # the parent of a sequence's first block


def block_hash(parent: int, token_ids: Sequence[int], extra: bytes = b"") -> int:
    """The 128-bit hash of one full block whose chain so far hashes to `parent`."""
    h = xxhash.xxh3_128()
    h.update(parent.to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(extra)
    return h.intdigest()


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH, start_block: int = 0,
                 num_blocks: int | None = None) -> list[int]:
    """The hashes of full blocks `start_block`, `start_block + 1`, ... of `token_ids` (only full blocks; at most
    `num_blocks` of them), continuing the chain from `parent`."""
    hashes = []
    end_block = len(token_ids) // block_size
    if num_blocks is not None:
        end_block = min(end_block, start_block + num_blocks)
    for b in range(start_block, end_block):
        parent = block_hash(parent, token_ids[b * block_size : (b + 1) * block_size])
        hashes.append(parent)
    return hashes
