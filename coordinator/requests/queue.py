"""The coordinator's waiting line: at most `max_running` generations on the workers, the rest
wait ordered by priority (1 first ... 5 last), then by arrival."""

from __future__ import annotations

import asyncio
import heapq
import itertools


class RequestQueue:
    """A priority semaphore; `acquire` may time out, and every successful acquire needs a `release`."""

    def __init__(self, max_running: int):
        self.max_running = max_running
        self.num_running = 0
        self.num_waiting = 0
        self._heap: list[tuple[int, int, asyncio.Future]] = []
        self._arrival = itertools.count()

    async def acquire(self, priority: int, timeout_s: float) -> None:
        """Wait for a turn; raises TimeoutError after `timeout_s` (and leaves the line)."""
        if self.num_running < self.max_running and self.num_waiting == 0:
            self.num_running += 1
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (priority, next(self._arrival), fut))
        self.num_waiting += 1
        try:
            await asyncio.wait_for(fut, max(timeout_s, 0.0))
        except BaseException:
            # Granted in the same instant it gave up: hand the turn straight on.
            if fut.done() and not fut.cancelled():
                self.release()
            else:
                self.num_waiting -= 1  # its cancelled future stays in the heap until popped
                fut.cancel()
            raise

    def release(self) -> None:
        self.num_running -= 1
        while self._heap and self.num_running < self.max_running:
            _, _, fut = heapq.heappop(self._heap)
            if not fut.done():
                self.num_running += 1
                self.num_waiting -= 1
                fut.set_result(None)
