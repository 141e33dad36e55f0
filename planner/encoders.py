"""The online planner's encode workers (no torch): how many the images of the last window needed.

Every Encode call the coordinator makes is recorded with the time its encode worker says it spent on it
(EncodeResponse.busy_ms: decoding its images and their share of the forwards they ran in, so batching counts once)
and the images it encoded; an image found cached costs no time. The window's encode seconds over
its length are the encode workers' busy share; divided by TARGET_UTILIZATION and rounded up, that is the count
wanted: never below one while there are encode workers (images keep coming to them), none where there are none
(the operator did not start encoder disaggregation). Up at once; down by one per decision, only after the count
asked for has stood for `scale_down_after_s`, as the other roles' damping does.
"""

from __future__ import annotations

import math
from collections import deque

from planner.settings import PlannerConfig

TARGET_UTILIZATION = 0.7  # headroom: a burst of new images must not queue behind a saturated encoder


class EncoderDemand:
    """Encode calls of the window, and the damped count of encode workers they ask for."""

    def __init__(self, config: PlannerConfig):
        self.config = config
        self._calls: deque[tuple[float, float, int]] = deque()  # (finished at, busy seconds, images encoded)
        self.desired: int | None = None
        self._lower_since: float | None = None

    def record(self, now: float, busy_s: float, encoded: int) -> None:
        self._calls.append((now, busy_s, encoded))
        self._forget(now)

    def busy_share(self, now: float) -> float:
        """The encode workers' busy seconds per second over the window (1.0: one worker always busy)."""
        self._forget(now)
        return sum(busy for _, busy, _ in self._calls) / self.config.window_s

    def _forget(self, now: float) -> None:
        while self._calls and self._calls[0][0] < now - self.config.window_s:
            self._calls.popleft()

    def decide(self, now: float, current: int, room: int) -> int:
        """The desired count given `current` routable encode workers and `room` more instances the cluster may
        hold (max_instances less the other roles' desired counts)."""
        if current == 0 and self.desired is None:
            return 0
        wanted = max(1, math.ceil(self.busy_share(now) / TARGET_UTILIZATION))
        wanted = min(wanted, current + max(0, room))
        if self.desired is None or wanted > self.desired:
            self.desired, self._lower_since = wanted, None
        elif wanted < self.desired:
            self._lower_since = self._lower_since if self._lower_since is not None else now
            if now - self._lower_since >= self.config.scale_down_after_s:
                self.desired, self._lower_since = self.desired - 1, None
        else:
            self._lower_since = None
        return self.desired
