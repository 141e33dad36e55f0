"""The identity of a full KV block: a hash chained over its tokens and every block before it (no torch).

Defined once here, and computed the same way by a worker's block pool (its prefix cache) and by the
coordinator (which looks a prompt up in the blocks the workers announce). Two blocks share a hash only if the
whole prefix up to their end is the same tokens, so a hit on block i is a hit on blocks 0..i. A LoRA adapter
changes every position's KV: a prompt run under one has each token id offset by a salt from the adapter's
identity (`lora_cache_tokens`), so it never meets the base model's or another adapter's blocks. An image (or
other media) changes the KV of the positions it fills without changing their placeholder ids, so those ids are
hashed as stand-ins made from the media's content hash (`media_cache_tokens`): the same image and text hit, a
different image never does. `extra` folds in anything else that changes a block's KV; the model and dtype are a
worker's own and need not be hashed.

hash(block) = xxh3_128(parent as 16 bytes little-endian || each token as int64 little-endian [|| extra]),
with parent = ROOT_HASH for a sequence's first block.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence

import xxhash

ROOT_HASH = 0  # the parent of a sequence's first block
HASH_BYTES = 16

_digest = xxhash.xxh3_128_intdigest
_MAX_SPAN_BLOCKS = 16
_LOW_63 = (1 << 63) - 1


def block_hash(parent: int, token_ids: Sequence[int], extra: bytes = b"") -> int:
    """The 128-bit hash of one full block whose chain so far hashes to `parent`."""
    return _digest(parent.to_bytes(HASH_BYTES, "little") + array("q", token_ids).tobytes() + extra)


def iter_chain_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH, start_block: int = 0,
                      num_blocks: int | None = None) -> Iterator[int]:
    """The hashes of full blocks `start_block`, `start_block + 1`, ... of `token_ids`, lazily (a caller that stops
    at its first miss pays for little more), continuing the chain from `parent`."""
    end_block = len(token_ids) // block_size
    if num_blocks is not None:
        end_block = min(end_block, start_block + num_blocks)
    step = block_size * 8
    # Tokens are converted in spans of 1, 2, 4 ... _MAX_SPAN_BLOCKS blocks: one conversion per span, then a digest per
    # block, and a lookup that misses at once converts one block only.
    span_start, span = start_block, 1
    while span_start < end_block:
        span_end = min(end_block, span_start + span)
        data = array("q", token_ids[span_start * block_size : span_end * block_size]).tobytes()
        for offset in range(0, len(data), step):
            parent = _digest(parent.to_bytes(HASH_BYTES, "little") + data[offset : offset + step])
            yield parent
        span_start, span = span_end, min(span * 2, _MAX_SPAN_BLOCKS)


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH, start_block: int = 0,
                 num_blocks: int | None = None) -> list[int]:
    """The hashes of full blocks `start_block`, `start_block + 1`, ... of `token_ids` (only full blocks; at most
    `num_blocks` of them), continuing the chain from `parent`."""
    return list(iter_chain_hashes(token_ids, block_size, parent, start_block, num_blocks))


def media_content_hash(data: bytes) -> int:
    """A media item's identity: the 128-bit hash of its encoded bytes (the file as fetched)."""
    return _digest(data)


def media_stand_in(content_hash: int) -> int:
    """The id hashed in place of each placeholder of a media item: negative (no token has it), from its content
    hash's low 63 bits."""
    return -1 - (content_hash & _LOW_63)


def media_cache_tokens(token_ids: Sequence[int], media: Iterable) -> list[int]:
    """`token_ids` as the prefix cache hashes them: each media item's span (its `offset`, `num_tokens` and
    `content_hash`: a worker's MediaSpan, a coordinator's MediaInput) replaced by its stand-in."""
    ids = list(token_ids)
    for item in media:
        ids[item.offset : item.offset + item.num_tokens] = [media_stand_in(item.content_hash)] * item.num_tokens
    return ids


_SALT_BITS = 31  # token ids are below 2**31: salted ids (salt << 31) + id never meet another salt's or a plain id


def lora_salt(digest: int) -> int:
    """The offset a LoRA adapter's identity (`adapters.peft_folder.adapter_digest`) adds to each prompt token id."""
    return (1 + (digest & ((1 << _SALT_BITS) - 2))) << _SALT_BITS


def lora_cache_tokens(token_ids: Sequence[int], digest: int | None) -> list[int]:
    """`token_ids` (media stand-ins already in place) as the prefix cache hashes them under the adapter whose
    identity is `digest` (None: the base model, unchanged). Stand-ins stay: the salted text around them decides."""
    if digest is None:
        return token_ids if isinstance(token_ids, list) else list(token_ids)
    salt = lora_salt(digest)
    return [t + salt if t >= 0 else t for t in token_ids]


def hash_to_bytes(h: int) -> bytes:
    """A block hash as the wire carries it (KvBlockEvent.hash)."""
    return h.to_bytes(HASH_BYTES, "little")


def hash_from_bytes(data: bytes) -> int:
    return int.from_bytes(data, "little")
