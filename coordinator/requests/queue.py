"""The coordinator's waiting line: at most `max_running` generations on the workers; the rest wait, served by
weighted fair share between tenants, then priority (1 first ... 5 last), then arrival.

Fair share is start-time fair queuing: each tenant with requests waiting has a line and a virtual start tag;
a turn goes to the line with the smallest tag, whose tag then grows by 1 / its weight. A tenant that floods
advances its own tag only, so it waits behind its own requests, while a tenant that sends a little finds
its tag at the line's virtual time and is served within a turn or two.

From the turns it grants while full (its drain rate) the line predicts when a new request would start; a
request that cannot start before its latest start (its deadline less its expected service time) is refused
at once (`CannotStartInTime`), and one still waiting at its latest start leaves the line then.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field

LEVELS = 5  # priorities 1 (first) ... 5 (last)
DEFAULT_LINE = ("default", 1.0)  # (tenant name, weight) of a request without a tenant
RATE_SAMPLES = 64  # the last turns granted while full, for the drain rate
RATE_HORIZON_S = 30.0  # older turns say nothing about the line's rate now
MIN_RATE_SAMPLES = 8  # fewer: no prediction (and no early refusal)


class CannotStartInTime(Exception):
    """The request would start after its latest start; `wait_s` is the predicted wait from `at` (the clock's)."""

    def __init__(self, wait_s: float, at: float):
        super().__init__(f"predicted wait {wait_s:.1f}s")
        self.wait_s = wait_s
        self.at = at


@dataclass
class _Line:
    """One tenant's waiting requests, by (priority, arrival), and its fair-share tag."""

    weight: float
    tag: float = 0.0
    heap: list = field(default_factory=list)
    by_level: list[int] = field(default_factory=lambda: [0] * (LEVELS + 1))  # requests waiting, by priority

    @property
    def waiting(self) -> int:
        return sum(self.by_level)


class RequestQueue:
    """A fair, priority semaphore; `acquire` may raise, and every successful acquire needs a `release`."""

    def __init__(self, max_running: int, refuse_early: bool = True, clock=time.monotonic):
        self.max_running = max_running
        self.clock = clock
        self.refuse_early = refuse_early
        self.num_running = 0
        self.num_waiting = 0
        self._lines: dict[str, _Line] = {}
        self._virtual = 0.0
        self._arrival = itertools.count()
        self._turns: deque[float] = deque(maxlen=RATE_SAMPLES)  # when each turn was granted while full

    async def acquire(self, priority: int, timeout_s: float, line: tuple[str, float] = DEFAULT_LINE) -> None:
        """Wait for a turn in tenant `line` = (name, weight); TimeoutError after `timeout_s` (its latest start; it
        leaves the line), CannotStartInTime at once when the prediction says it would start later than that."""
        if self.num_running < self.max_running and self.num_waiting == 0:
            self.num_running += 1
            return
        name, weight = line
        tenant = self._lines.get(name)  # a line in the dict has requests waiting (an idle one is dropped)
        if tenant is None:
            tenant = self._lines[name] = _Line(weight, self._virtual)
        tenant.weight = weight  # the keys file may have been reloaded
        if self.refuse_early:
            wait = self.predicted_wait(tenant, priority)
            if wait > timeout_s:
                self._forget_if_idle(name, tenant)
                raise CannotStartInTime(wait, self.clock())
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(tenant.heap, (priority, next(self._arrival), fut))
        tenant.by_level[priority] += 1
        self.num_waiting += 1
        try:
            await asyncio.wait_for(fut, max(timeout_s, 0.0))
        except BaseException:
            # Granted in the same instant it gave up: hand the turn straight on.
            if fut.done() and not fut.cancelled():
                self.release()
            else:
                fut.cancel()  # it stays in the heap until popped
                self._left(name, tenant, priority)
            raise

    def release(self) -> None:
        self.num_running -= 1
        while self.num_waiting and self.num_running < self.max_running:
            name, tenant = min(self._lines.items(), key=lambda item: (item[1].tag, item[1].heap[0][1]))
            priority, _, fut = heapq.heappop(tenant.heap)
            if fut.done():  # cancelled: already uncounted
                continue
            self._virtual = tenant.tag
            tenant.tag += 1.0 / tenant.weight
            self.num_running += 1
            self._turns.append(self.clock())
            fut.set_result(None)
            self._left(name, tenant, priority)

    def drain_rate(self) -> float | None:
        """Turns per second granted while full, over the recent ones; None: too few to say."""
        turns, now = self._turns, self.clock()
        while turns and now - turns[0] > RATE_HORIZON_S:
            turns.popleft()
        if len(turns) < MIN_RATE_SAMPLES or turns[-1] <= turns[0]:
            return None
        # The time since the last turn counts too: a line that stopped turning drains slower than its past.
        return (len(turns) - 1) / max(turns[-1] - turns[0], now - turns[0])

    def predicted_wait(self, tenant: _Line, priority: int) -> float:
        """Seconds until a request of `tenant` at `priority` would start (0 when the line cannot say): the turns
        ahead of it (its tenant's at its priority or before, times the tenants sharing the turns by weight,
        at most all waiting) over the drain rate."""
        rate = self.drain_rate()
        if rate is None:
            return 0.0
        own = sum(tenant.by_level[1:priority + 1]) + 1
        shares = sum(t.weight for t in self._lines.values()) / tenant.weight  # `tenant` is in the dict
        ahead = min(math.ceil(own * shares), self.num_waiting + 1)
        return ahead / rate

    def _left(self, name: str, tenant: _Line, priority: int) -> None:
        """A request of `tenant` at `priority` left the waiting (its turn came, or it gave up)."""
        tenant.by_level[priority] -= 1
        self.num_waiting -= 1
        self._forget_if_idle(name, tenant)

    def _forget_if_idle(self, name: str, tenant: _Line) -> None:
        # An idle tenant's tag starts again at the virtual time, as a returning tenant's would.
        if tenant.waiting == 0:
            tenant.heap.clear()  # only cancelled futures left
            self._lines.pop(name, None)
