"""Reusable receive buffers: fresh memory costs a page fault per 4 KiB, which halves receive speed."""

from __future__ import annotations

import threading

import torch


class KvBufferPool:
    """Hands out byte buffers of at least the asked size and takes them back for the next transfer."""

    def __init__(self, max_pooled_bytes: int = 1 << 30):
        self.max_pooled_bytes = max_pooled_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._pooled = 0
        self._lock = threading.Lock()

    @staticmethod
    def _size_class(nbytes: int) -> int:
        return max(1 << 20, 1 << (nbytes - 1).bit_length())

    @property
    def pooled_bytes(self) -> int:
        return self._pooled

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of exactly `nbytes` (a view of a pooled or new allocation)."""
        size = self._size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                self._pooled -= size
                return free.pop()[:nbytes]
        return torch.empty(size, dtype=torch.uint8)[:nbytes]

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer from `take`; it is kept for reuse while the pool has room."""
        base = buffer._base if buffer._base is not None else buffer
        size = base.numel()
        if size != self._size_class(size):
            return
        with self._lock:
            if self._pooled + size <= self.max_pooled_bytes:
                self._free.setdefault(size, []).append(base)
                self._pooled += size
