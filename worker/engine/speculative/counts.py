"""A drafting worker's acceptance counts (no numpy: the metrics module of every worker, simulated ones too,
imports them)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# Why a row did not draft in a step (the skipped-rows metric's reasons).
SKIP_REASONS = ("batch_size", "request_off", "guided", "cooldown", "no_match", "length", "no_blocks")


@dataclass
class DraftCounts:
    """The worker's acceptance counts since start."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)
