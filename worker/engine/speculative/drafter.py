"""Which decode rows draft in a step, and what: the per-request drafting state, the rules that turn drafting off
where it would slow (a big batch, a request that keeps rejecting, the client's switch), and the acceptance counts
the worker's metrics read (named after vLLM's `spec_decode_*`)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from worker.engine.sequence import Sequence
from worker.engine.speculative.config import SpeculativeConfig
from worker.engine.speculative.counts import DraftCounts
from worker.engine.speculative.proposers import TokenHistory, make_proposer

@dataclass
class DraftState:
    """One request's drafting: its text so far, the coordinator's hints, its cool-down and acceptance counts."""

    history: TokenHistory
    hints: list[np.ndarray]
    outputs_seen: int = 0  # output tokens already in `history`
    cooldown: int = 0  # steps the last all-rejected draft costs it (0: none yet); doubles while drafts fail
    resume_at: int = 0  # the engine step from which it drafts again
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified step (vLLM's definition: 1 + accepted per draft); 0 if it never drafted."""
        return 1 + self.accepted / self.drafts if self.drafts else 0.0


class Drafter:
    """Plans each step's drafts (`plan`) and learns what verification accepted (`verified`); engine thread only."""

    def __init__(self, config: SpeculativeConfig, proposer=None, vocab_size: int = 1 << 31):
        self.config = config
        self.vocab_size = vocab_size  # the engine's model's (hints beyond it are dropped)
        self.proposer = proposer or make_proposer(config)
        self.counts = DraftCounts(accepted_per_position=[0] * config.num_speculative_tokens)
        self.step = 0

    def plan(self, batch: Seq[Sequence]) -> list[list[int]]:
        """A draft for each row of the step's batch ([]: it decodes one token as without drafts)."""
        self.step += 1
        if len(batch) > self.config.disable_batch_size:
            self.counts.skipped["batch_size"] += len(batch)
            return [[] for _ in batch]
        return [self._draft(seq) for seq in batch]

    def _draft(self, seq: Sequence) -> list[int]:
        reason = self._reason_not_to(seq)
        if reason is None:
            state = self._state(seq)
            # A draft of k tokens emits up to k + 1: never more than the request may still generate.
            room = min(seq.sampling.max_tokens - seq.num_generated, seq.max_seq_len - seq.total_len) - 1
            k = min(self.config.num_speculative_tokens, room)
            if k <= 0:
                reason = "length"
            else:
                draft = self.proposer.propose(state.history.view, state.hints, k)[:k]
                if draft:
                    return draft
                reason = "no_match"
        self.counts.skipped[reason] += 1
        return []

    def _reason_not_to(self, seq: Sequence) -> str | None:
        if seq.no_drafts:
            return "request_off"
        if seq.matcher is not None:
            # A grammar's matcher advances token by token: drafts would need it rolled back on rejection.
            return "guided"
        if seq.drafts is not None and self.step < seq.drafts.resume_at:
            return "cooldown"
        return None

    def _state(self, seq: Sequence) -> DraftState:
        state = seq.drafts
        if state is None:
            hints = [np.asarray(h, dtype=np.int64) for h in seq.draft_hints if len(h) > 1]
            # A hint is the coordinator's guess: one naming a token outside this model's vocabulary is dropped.
            hints = [h for h in hints if h.min() >= 0 and h.max() < self.vocab_size]
            state = seq.drafts = DraftState(TokenHistory(seq.prompt_token_ids), hints)
        if state.outputs_seen < seq.num_generated:
            state.history.extend(seq.output_token_ids[state.outputs_seen :])
            state.outputs_seen = seq.num_generated
        return state

    def skipped(self, reason: str) -> None:
        """A planned draft the engine could not run (`no_blocks`: the pool had no room for its positions)."""
        self.counts.skipped[reason] += 1

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Verification of a `drafted`-token draft accepted its first `accepted` tokens."""
        state, counts = seq.drafts, self.counts
        state.drafts += 1
        state.draft_tokens += drafted
        state.accepted += accepted
        counts.drafts += 1
        counts.draft_tokens += drafted
        counts.accepted += accepted
        for position in range(accepted):
            counts.accepted_per_position[position] += 1
        if accepted:
            state.cooldown = 0
        else:
            cfg = self.config
            state.cooldown = min(cfg.max_cooldown_steps, max(cfg.cooldown_steps, 2 * state.cooldown)) \
                if cfg.cooldown_steps else 0
            state.resume_at = self.step + 1 + state.cooldown
