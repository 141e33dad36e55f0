"""Speculative decoding's step on the real engine: which rows carry drafts (their positions given blocks), the
chunks that verify them in the step's forward, and the run of tokens each row emits.

A drafted row enters the forward as a short chunk over its cache: its last token and the k draft tokens, with
logits after each. At every position the row picks the token it would pick without drafts (the same processing,
the same seeded draw at the same output index), and the draft is accepted while it equals those picks; the first
pick that differs, or the bonus pick after a whole draft, ends the run. A greedy row thus emits exactly its greedy
tokens; a sampled one accepts a draft token d with probability p(d) and otherwise draws from p without d: exactly
the model's distribution (and, for a seeded request, the same tokens as without drafts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from worker.engine.block_pool import BlockPool
from worker.engine.sequence import Sequence
from worker.engine.speculative.drafter import Drafter
from worker.torch_engine.model_runner import PromptChunk
from worker.torch_engine.sampling import Pick, choose_batch

Drafted = list[tuple[Sequence, list[int]]]


def split_drafted(drafter: Drafter | None, pool: BlockPool, batch: list[Sequence]) -> tuple[list[Sequence], Drafted]:
    """The batch split into rows that decode one token and rows with a draft whose positions have blocks."""
    if drafter is None or not batch:
        return batch, []
    plain, drafted = [], []
    for seq, draft in zip(batch, drafter.plan(batch)):
        if draft and not pool.grow(seq.table, seq.total_len + len(draft)):
            drafter.skipped("no_blocks")
            draft = []
        if draft:
            drafted.append((seq, draft))
        else:
            plain.append(seq)
    return plain, drafted


@contextlib.contextmanager
def drafts_given_back_on_failure(pool: BlockPool, drafted: Drafted):
    """If the step's forward raises, the drafts' positions go back: the rows run again as they were."""
    try:
        yield
    except Exception:
        for seq, _ in drafted:
            pool.shrink(seq.table, seq.total_len)
        raise


def verify_chunks(drafted: Drafted) -> list[PromptChunk]:
    """Each drafted row's chunk: its last token and the draft at their positions, logits after every one."""
    return [PromptChunk([seq.output_token_ids[-1], *draft], seq.total_len - 1, seq.table, True, lora=seq.lora,
                        verify=True) for seq, draft in drafted]


def verified_runs(drafted: Drafted, logits, drafter: Drafter, eos_ids: Iterable[int], masks
                  ) -> list[tuple[Sequence, list[Pick]]]:
    """Each drafted row's tokens to emit (with their logprobs), from its chunk's logits; the drafter learns what
    was accepted."""
    if not drafted:
        return []
    positions = [_DraftPosition(seq, seq.output_token_ids + draft[:j])
                 for seq, draft in drafted for j in range(len(draft) + 1)]
    picks = choose_batch(logits, positions, eos_ids, masks)
    runs, at = [], 0
    for seq, draft in drafted:
        own, at = picks[at : at + len(draft) + 1], at + len(draft) + 1
        accepted = 0
        while accepted < len(draft) and own[accepted][0] == draft[accepted]:
            accepted += 1
        drafter.verified(seq, len(draft), accepted)
        runs.append((seq, own[: accepted + 1]))
    return runs


class _DraftPosition:
    """A drafted row as sampling sees it at one position: its output as if the draft before it were accepted (no
    grammar: guided rows do not draft)."""

    __slots__ = ("sampling", "prompt_token_ids", "output_token_ids", "matcher")

    def __init__(self, seq: Sequence, output_token_ids: list[int]):
        self.sampling, self.prompt_token_ids, self.matcher = seq.sampling, seq.prompt_token_ids, None
        self.output_token_ids = output_token_ids
