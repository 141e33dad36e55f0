"""A token bucket that may go into debt: what is taken beyond its level is paid back by refill first."""

from __future__ import annotations

import math
import time


class TokenBucket:
    """`rate` per second up to `capacity`; starts full."""

    __slots__ = ("rate", "capacity", "level", "_at", "_clock")

    def __init__(self, per_minute: float, burst_s: float, clock=time.monotonic):
        self.rate = per_minute / 60.0
        self.capacity = max(self.rate * burst_s, 1.0)
        self._clock = clock
        self._at = clock()
        self.level = self.capacity

    def refill(self) -> float:
        now = self._clock()
        self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
        self._at = now
        return self.level

    def can_take(self, amount: float) -> bool:
        """Whether `amount` may be taken now: the bucket holds it, or is full (an amount larger than the bucket
        is let through from a full one, into debt, or it could never pass)."""
        level = self.refill()
        return level >= min(amount, self.capacity)

    def take(self, amount: float) -> None:
        self.refill()
        self.level -= amount

    def give_back(self, amount: float) -> None:
        self.refill()
        self.level = min(self.capacity, self.level + amount)

    def wait_s(self, amount: float) -> int:
        """Whole seconds until `can_take(amount)`; at least 1 (Retry-After's unit)."""
        short = min(amount, self.capacity) - self.refill()
        return max(1, math.ceil(short / self.rate)) if self.rate > 0 else 1
