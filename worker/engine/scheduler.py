"""Which work runs next. Pure bookkeeping: no torch, no threads."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

from worker.engine.sequence import DecodeState, Sequence


class DecodeScheduler:
    """The decode batch: sequences join at the next step (up to `max_running`) and leave at once."""

    def __init__(self, max_running: int = 64):
        self.max_running = max_running
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], list[Sequence]]:
        """Admit waiting sequences up to `max_running`; return (newly joined, whole batch)."""
        joined = []
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting.pop(0)
            self.running.append(seq)
            joined.append(seq)
        return joined, list(self.running)

    def finish(self, seq: Sequence, status: DecodeState = DecodeState.FINISHED) -> None:
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running + self.waiting:
            if seq.request_id == request_id:
                return seq
        return None


class PrefillItem(Protocol):
    num_tokens: int


class PrefillScheduler:
    """Groups queued prompts into one forward within a padded-token and a batch-size budget.

    The oldest prompt always goes first, alone if it is over the token budget, so a long prompt
    is never starved; younger prompts that fit ride along, so short ones never wait long.
    """

    def __init__(self, max_batch_tokens: int = 8192, max_batch_size: int = 16):
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.queue: list = []

    @property
    def num_queued_tokens(self) -> int:
        return sum(item.num_tokens for item in self.queue)

    def add(self, item: PrefillItem) -> None:
        self.queue.append(item)

    def remove(self, item: PrefillItem) -> None:
        if item in self.queue:
            self.queue.remove(item)

    def next_batch(self) -> Seq:
        if not self.queue:
            return []
        batch = [self.queue[0]]
        width = self.queue[0].num_tokens
        for item in self.queue[1:]:
            if len(batch) >= self.max_batch_size:
                break
            new_width = max(width, item.num_tokens)
            if new_width * (len(batch) + 1) <= self.max_batch_tokens:  # padded cost of the forward
                batch.append(item)
                width = new_width
        for item in batch:
            self.queue.remove(item)
        return batch
