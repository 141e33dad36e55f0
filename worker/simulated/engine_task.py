"""How a simulated engine runs: one event-loop task (no threads), waiting on the cost model's clock."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine

logger = logging.getLogger(__name__)


class EngineTask:
    """A simulated engine's loop as one event-loop task: started, woken when work arrives, cancelled."""

    def __init__(self, run: Callable[[], Coroutine]):
        self._run = run
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())
        self._task.add_done_callback(_report_crash)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def wake(self) -> None:
        self._wake.set()

    async def wait_for_work(self) -> None:
        self._wake.clear()
        await self._wake.wait()


class RunsOnEventLoop:
    """`start` and `shutdown` of a simulated engine whose loop is `self._task`, an EngineTask."""

    _task: EngineTask

    def start(self) -> None:
        self._task.start()

    def shutdown(self) -> None:
        self._task.stop()


def _report_crash(task: asyncio.Task) -> None:
    # An engine loop that dies would hang every request quietly; say so loudly instead.
    if not task.cancelled() and task.exception() is not None:
        logger.error("simulated engine loop stopped", exc_info=task.exception())


async def sleep_until(deadline: float) -> None:
    """Sleep until `deadline` on the time.perf_counter clock (at once if it has passed)."""
    delay = deadline - time.perf_counter()
    if delay <= 0:
        await asyncio.sleep(0)
    # uvloop's timers tick in whole milliseconds and can fire up to one early: a simulated cost is never cut short.
    while delay > 0:
        await asyncio.sleep(delay)
        delay = deadline - time.perf_counter()
