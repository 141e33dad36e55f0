"""PeriodicRounds: rounds plain or async, one that raises logged and the next one tried, stopped for good."""

from __future__ import annotations

import asyncio
import logging

from coordinator.periodic_rounds import PeriodicRounds
from tests.helpers import wait_until


async def test_a_round_that_raises_is_logged_and_the_next_one_runs(caplog):
    calls = []

    def round():
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("bad round")

    rounds = PeriodicRounds(round, 0.01, "test round")
    with caplog.at_level(logging.ERROR, logger="coordinator.periodic_rounds"):
        rounds.start()
        await wait_until(lambda: len(calls) >= 3)
        await rounds.stop()
    assert "test round failed" in caplog.text and "bad round" in caplog.text


async def test_async_rounds_are_awaited_and_none_runs_after_stop():
    done = []

    async def round():
        await asyncio.sleep(0)
        done.append(1)

    rounds = PeriodicRounds(round, 0.01, "test round")
    rounds.start()
    await wait_until(lambda: len(done) >= 2)
    await rounds.stop()
    assert rounds._task.done()  # its task is over: no round can follow
