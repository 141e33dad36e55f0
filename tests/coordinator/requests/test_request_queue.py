"""The coordinator's waiting line: priority first, then arrival; deadlines leave the line."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.requests.queue import RequestQueue


async def test_waiters_are_served_by_priority_then_arrival():
    queue = RequestQueue(max_running=1)
    await queue.acquire(5, 1)
    order = []

    async def wait(name: str, priority: int):
        await queue.acquire(priority, 5)
        order.append(name)
        queue.release()

    tasks = []
    for name, priority in (("low-1", 5), ("high", 1), ("mid", 3), ("low-2", 5), ("high-2", 1)):
        tasks.append(asyncio.create_task(wait(name, priority)))
        await asyncio.sleep(0)
    assert queue.num_waiting == 5
    queue.release()
    await asyncio.gather(*tasks)
    assert order == ["high", "high-2", "mid", "low-1", "low-2"]
    assert queue.num_running == 0 and queue.num_waiting == 0


async def test_a_waiter_past_its_deadline_leaves_without_taking_a_turn():
    queue = RequestQueue(max_running=1)
    await queue.acquire(5, 1)
    with pytest.raises(asyncio.TimeoutError):
        await queue.acquire(1, 0.05)
    assert queue.num_waiting == 0
    queue.release()
    assert queue.num_running == 0
    await queue.acquire(5, 0.05)  # the turn was not lost to the one that gave up
    assert queue.num_running == 1


async def test_a_cancelled_waiter_leaves_the_line():
    queue = RequestQueue(max_running=1)
    await queue.acquire(5, 1)
    waiter = asyncio.create_task(queue.acquire(1, 5))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    queue.release()
    assert queue.num_running == 0 and queue.num_waiting == 0
