"""PeriodicRounds: one background task calling a round every interval, for the coordinator's watchers."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)


class PeriodicRounds:
    """Calls `round` (plain or async) every `interval_s` on a task of its own, the first after one interval. A round
    that raises is logged as `what` failed and the next one is tried: a watcher must outlive any one bad round."""

    def __init__(self, round: Callable[[], object | Awaitable[object]], interval_s: float, what: str):
        self.round = round
        self.interval_s = interval_s
        self.what = what
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                result = self.round()
                if inspect.isawaitable(result):
                    await result
            except Exception:
                logger.exception("%s failed", self.what)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
