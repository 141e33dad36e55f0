"""KV memory accounting in token positions: a budget, and a FIFO line of requests waiting for it."""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict

logger = logging.getLogger(__name__)


class KvCapacityError(Exception):
    """A request whose KV reservation can never fit this worker's budget."""


class KvBudget:
    """Token positions of KV cache a worker may hold; every holder is named by request id."""

    def __init__(self, capacity_tokens: int):
        if capacity_tokens <= 0:
            raise ValueError(f"capacity_tokens={capacity_tokens} must be > 0")
        self.capacity = capacity_tokens
        self._held: dict[str, int] = {}

    @property
    def used(self) -> int:
        return sum(self._held.values())

    @property
    def num_holders(self) -> int:
        return len(self._held)

    def can_allocate(self, tokens: int) -> bool:
        return self.used + tokens <= self.capacity

    def allocate(self, request_id: str, tokens: int) -> None:
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} already holds KV budget")
        if not self.can_allocate(tokens):
            raise KvCapacityError(f"{tokens} tokens do not fit: {self.used} of {self.capacity} in use")
        self._held[request_id] = tokens

    def free(self, request_id: str) -> int:
        """Release what `request_id` holds (nothing if it holds nothing); return the tokens freed."""
        return self._held.pop(request_id, 0)


class KvAdmission:
    """Requests wait here, first come first served, until the budget can hold them."""

    def __init__(self, budget: KvBudget):
        self.budget = budget
        self._waiting: OrderedDict[str, tuple[int, asyncio.Future]] = OrderedDict()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    async def acquire(self, request_id: str, tokens: int) -> None:
        """Wait until `tokens` are allocated to `request_id`; raise at once if they never could be."""
        if tokens > self.budget.capacity:
            raise KvCapacityError(
                f"request needs {tokens} tokens of KV cache but this worker's whole budget is "
                f"{self.budget.capacity} tokens"
            )
        if not self._waiting and self.budget.can_allocate(tokens):
            self.budget.allocate(request_id, tokens)
            return
        future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = (tokens, future)
        try:
            await future
        except asyncio.CancelledError:
            self._waiting.pop(request_id, None)
            if future.done() and not future.cancelled():
                self.release(request_id)  # admitted and cancelled in the same tick
            raise

    def release(self, request_id: str) -> None:
        """Free what `request_id` holds, or take it out of the line, and admit whoever now fits."""
        waiting = self._waiting.pop(request_id, None)
        if waiting is not None:
            waiting[1].cancel()
        self.budget.free(request_id)
        while self._waiting:
            rid, (tokens, future) = next(iter(self._waiting.items()))
            if future.done():  # cancelled, and its waiter has not yet run to leave the line
                del self._waiting[rid]
                continue
            if not self.budget.can_allocate(tokens):
                break
            del self._waiting[rid]
            self.budget.allocate(rid, tokens)
            future.set_result(None)


# On the host, the pool is capped: several workers (and the OS) share one machine's memory, and a prefix cache
# fills whatever it is given. vLLM's CPU build defaults to 4 GiB (VLLM_CPU_KVCACHE_SPACE) for the same reason.
HOST_POOL_CAP_BYTES = 4 << 30


def default_capacity_tokens(bytes_per_token: int, device_type: str = "cpu", memory_fraction: float = 0.4,
                            reserved_bytes: int = 0) -> int:
    """A pool size from the memory free now, less `reserved_bytes` (what is yet to be allocated beside it): a
    `memory_fraction` of it (on the host, at most 4 GiB), in token positions."""
    available = max(0, _available_memory_bytes(device_type) - reserved_bytes)
    size = int(available * memory_fraction)
    if device_type == "cpu":
        size = min(size, HOST_POOL_CAP_BYTES)
    tokens = size // max(1, bytes_per_token)
    logger.info("KV budget %d tokens (%.1f GiB available, %d bytes per token)", tokens, available / 2**30,
                bytes_per_token)
    return max(tokens, 1)


def _available_memory_bytes(device_type: str) -> int:
    if device_type == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
