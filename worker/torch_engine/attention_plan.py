"""What the paged kernel attends in one forward: block tables, one entry per query token, and work items.

Decode rows that hold the same leading blocks (a system prompt, a conversation's history, the n choices of one
prompt) are grouped: a group's shared blocks are read once for all its rows, whatever the other rows hold, and
each row then reads only its own blocks. A prompt chunk with earlier positions is cut into tiles of
`PROMPT_TILE` tokens, each reading its sequence's blocks once for all its tokens, causally. Built once per
forward on the host; every layer reads it (`kernels/paged_attention.cpp` documents the layout).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Leading blocks rows must share to be read once for the group (fewer: each row reads them, no worse).
MIN_SHARED_BLOCKS = 2
GROUP_ROWS = 16  # rows per work item of a group: big groups are split so that every core has work
PROMPT_TILE = 16  # prompt tokens per work item


@dataclass(frozen=True)
class KernelPlan:
    """The kernel's inputs beyond the tensors: tables [rows, width], queries [Q, 3] (token, table row, last
    position), items [I, 3] (first query, end, shared blocks), all int32 on the host."""

    tables: torch.Tensor
    queries: torch.Tensor
    items: torch.Tensor


def decode_groups(tables: Sequence[Sequence[int]], positions: Sequence[int], block_size: int
                  ) -> list[tuple[list[int], int]]:
    """Decode rows (their block ids and current positions) as (rows, shared leading blocks) groups. Rows sharing
    a prefix form a group; within it, rows sharing MIN_SHARED_BLOCKS more (the choices of one prompt under a
    common system prompt) form their own, deeper one. A row sharing too little with any other is alone, with 0."""
    limits = [p // block_size for p in positions]  # blocks wholly before each row's current one
    groups: list[tuple[list[int], int]] = []
    alone = _group(list(range(len(tables))), 0, tables, limits, groups)
    groups.extend(([r], 0) for r in alone)
    return groups


def _group(rows: list[int], known: int, tables: Sequence[Sequence[int]], limits: list[int],
           groups: list[tuple[list[int], int]]) -> list[int]:
    """Add to `groups` the groups among `rows` (which share `known` leading blocks) sharing MIN_SHARED_BLOCKS
    more; return the rows left in none."""
    by_next: dict[int, list[int]] = defaultdict(list)
    rest: list[int] = []
    for r in rows:
        (by_next[tables[r][known]] if limits[r] > known else rest).append(r)
    for bucket in by_next.values():
        shared = _common_blocks([tables[r] for r in bucket], min(limits[r] for r in bucket))
        if len(bucket) < 2 or shared - known < MIN_SHARED_BLOCKS:
            rest.extend(bucket)
            continue
        members = _group(bucket, shared, tables, limits, groups)
        if len(members) == 1:
            rest.extend(members)
        for i in range(0, len(members) if len(members) > 1 else 0, GROUP_ROWS):
            groups.append((members[i : i + GROUP_ROWS], shared))
    return rest


def _common_blocks(tables: list[Sequence[int]], limit: int) -> int:
    """How many leading block ids (at most `limit`) every table holds alike."""
    low, high = min(tables), max(tables)  # lexicographic: their common prefix is everyone's
    n = 0
    while n < limit and low[n] == high[n]:
        n += 1
    return n


def build_plan(decode: Sequence[tuple[Sequence[int], int]], chunks: Sequence[tuple[Sequence[int], int, int, int]],
               block_size: int) -> KernelPlan:
    """`decode`: (block ids, position) per decode row, its token at the row's index; `chunks`: (block ids, first
    token in the packed row, first position, length) per prompt chunk the kernel attends."""
    tables: list[Sequence[int]] = [ids for ids, _ in decode]
    queries: list[tuple[int, int, int]] = []
    items: list[tuple[int, int, int]] = []
    for rows, shared in decode_groups(tables, [p for _, p in decode], block_size):
        first = len(queries)
        queries.extend((r, r, decode[r][1]) for r in rows)
        items.append((first, len(queries), shared))
    for ids, token, start, length in chunks:
        row = len(tables)
        tables.append(ids)
        for t in range(0, length, PROMPT_TILE):
            n = min(PROMPT_TILE, length - t)
            first = len(queries)
            queries.extend((token + t + i, row, start + t + i) for i in range(n))
            items.append((first, len(queries), (start + t + n - 1) // block_size + 1))
    width = max(len(ids) for ids in tables)
    padded = [list(ids) + [0] * (width - len(ids)) for ids in tables]
    return KernelPlan(torch.tensor(padded, dtype=torch.int32), torch.tensor(queries, dtype=torch.int32),
                      torch.tensor(items, dtype=torch.int32))
