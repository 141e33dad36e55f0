"""Which sequences run in the next decode step. Pure bookkeeping: no torch, no threads."""

from __future__ import annotations

from worker.sequence import Sequence, SequenceStatus


class DecodeScheduler:
    """Holds the running sequences; a sequence joins at the next step and leaves at once."""

    def __init__(self, max_running: int = 256):
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

    def schedule(self) -> list[Sequence]:
        """Admit waiting sequences up to `max_running` and return this step's batch."""
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return list(self.running)

    def finish(self, seq: Sequence, status: SequenceStatus = SequenceStatus.FINISHED) -> None:
        seq.status = status
        seq.kv_cache = None
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running + self.waiting:
            if seq.request_id == request_id:
                return seq
        return None
