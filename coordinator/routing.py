"""Picking a prefill and a decode instance for each request."""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class Route:
    """The pair of workers that serve one request."""

    prefill: str
    decode: str


class RoundRobinRouter:
    """Cycles through each instance list independently."""

    def __init__(self, prefill: list[str], decode: list[str]):
        if not prefill or not decode:
            raise ValueError("at least one prefill and one decode instance are required")
        self.prefill = list(prefill)
        self.decode = list(decode)
        self._next_prefill = itertools.cycle(self.prefill)
        self._next_decode = itertools.cycle(self.decode)

    def route(self) -> Route:
        return Route(prefill=next(self._next_prefill), decode=next(self._next_decode))

    def next_prefill(self, exclude: list[str]) -> str | None:
        """Another prefill instance for a retry, or None when every one has been tried."""
        for _ in range(len(self.prefill)):
            candidate = next(self._next_prefill)
            if candidate not in exclude:
                return candidate
        return None
