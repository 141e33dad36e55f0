"""The block hash both ends compute: chained block by block, whatever span the tokens are converted in."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from kv_events.block_hash import (ROOT_HASH, block_hash, chain_hashes, hash_from_bytes, hash_to_bytes,
                                  iter_chain_hashes)


def test_the_chain_equals_hashing_each_block_after_its_parent_across_every_span():
    rng = random.Random(1)
    tokens = [rng.randrange(1 << 20) for _ in range(16 * 100 + 7)]  # 100 full blocks and a partial one
    expected, parent = [], ROOT_HASH
    for b in range(100):
        parent = block_hash(parent, tokens[b * 16 : (b + 1) * 16])
        expected.append(parent)
    assert chain_hashes(tokens, 16) == expected
    assert chain_hashes(tokens, 16, parent=expected[40], start_block=41, num_blocks=30) == expected[41:71]
    assert list(iter_chain_hashes(tokens, 16, num_blocks=0)) == [] and chain_hashes(tokens[:15], 16) == []


def test_a_hash_crosses_the_wire_unchanged():
    h = chain_hashes(list(range(32)), 16)[1]
    assert len(hash_to_bytes(h)) == 16 and hash_from_bytes(hash_to_bytes(h)) == h


@pytest.mark.system  # a fresh interpreter: this one has imported torch long ago
def test_the_hash_and_the_coordinators_index_load_no_torch():
    code = "import sys, kv_events.block_hash, coordinator.scheduling.kv_index; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_media_placeholders_hash_as_their_content_so_only_the_same_image_gives_the_same_blocks():
    from collections import namedtuple

    from kv_events.block_hash import media_cache_tokens

    Span = namedtuple("Span", "offset num_tokens content_hash")  # what a MediaSpan or a MediaInput carries
    ids = list(range(4)) + [7] * 28
    red, blue = media_cache_tokens(ids, [Span(4, 28, 111)]), media_cache_tokens(ids, [Span(4, 28, 222)])
    assert red[:4] == ids[:4] and len(set(red[4:])) == 1 and red[4] < 0
    assert chain_hashes(red, 16) == chain_hashes(media_cache_tokens(ids, [Span(4, 28, 111)]), 16)
    assert chain_hashes(red, 16)[0] != chain_hashes(blue, 16)[0] != chain_hashes(ids, 16)[0]
