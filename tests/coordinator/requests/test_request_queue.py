"""The coordinator's waiting line: priority first, then arrival; deadlines leave the line."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.requests.queue import CannotStartInTime, RequestQueue


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


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def queued(queue: RequestQueue, count: int, line, priority: int = 5, order: list | None = None) -> list:
    async def wait(index: int):
        await queue.acquire(priority, 60, line)
        if order is not None:
            order.append((line[0], index) if priority == 5 else (line[0], index, priority))

    tasks = [asyncio.create_task(wait(i)) for i in range(count)]
    await asyncio.sleep(0)
    return tasks


async def full_line() -> RequestQueue:
    """A line of one place, taken: every next request waits."""
    queue = RequestQueue(max_running=1)
    await queue.acquire(5, 1)
    return queue


async def grant(queue: RequestQueue, turns: int, clock: FakeClock | None = None, step_s: float = 0.1) -> None:
    for _ in range(turns):
        if clock is not None:
            clock.now += step_s
        queue.release()
        await asyncio.sleep(0)


async def test_a_tenant_sending_a_little_is_served_within_two_turns_of_a_flooding_tenants_line():
    queue, order = await full_line(), []
    tasks = await queued(queue, 30, ("flood", 1.0), order=order)
    tasks += await queued(queue, 2, ("light", 1.0), order=order)
    await grant(queue, 32)
    await asyncio.gather(*tasks)
    light_turns = [turn for turn, (name, _) in enumerate(order) if name == "light"]
    assert light_turns == [1, 3]  # one turn each way, not after the flood's 30
    assert [i for name, i in order if name == "flood"] == list(range(30))  # arrival order within a tenant


async def test_weights_share_the_turns_of_a_full_line():
    queue, order = await full_line(), []
    tasks = await queued(queue, 60, ("heavy", 3.0), order=order)
    tasks += await queued(queue, 60, ("single", 1.0), order=order)
    await grant(queue, 40)
    assert abs(sum(name == "heavy" for name, _ in order) - 30) <= 1
    await grant(queue, 81)
    await asyncio.gather(*tasks)


async def test_within_a_tenant_priority_comes_before_arrival_and_other_tenants_keep_their_share():
    queue, order = await full_line(), []
    tasks = await queued(queue, 4, ("a", 1.0), priority=5, order=order)
    tasks += await queued(queue, 2, ("a", 1.0), priority=1, order=order)
    tasks += await queued(queue, 3, ("b", 1.0), priority=5, order=order)
    await grant(queue, 10)
    await asyncio.gather(*tasks)
    # a's two priority-1 requests took its first two turns; b kept every other turn.
    assert order == [("a", 0, 1), ("b", 0), ("a", 1, 1), ("b", 1), ("a", 0), ("b", 2), ("a", 1), ("a", 2), ("a", 3)]


async def test_a_request_that_cannot_start_before_its_latest_start_is_refused_at_once():
    clock = FakeClock()
    queue = RequestQueue(max_running=1, clock=clock)
    await queue.acquire(5, 1)
    tasks = await queued(queue, 30, ("a", 1.0))
    await grant(queue, 10, clock, step_s=0.1)  # 10 turns a second while full; 20 still waiting
    assert queue.drain_rate() == pytest.approx(10, rel=0.15)
    with pytest.raises(CannotStartInTime) as refused:
        await queue.acquire(5, 1.0, ("a", 1.0))
    assert refused.value.wait_s == pytest.approx(2.1, rel=0.15)
    assert queue.num_waiting == 20
    # Another tenant shares the turns by weight: its first request starts in about two turns.
    later = asyncio.create_task(queue.acquire(5, 1.0, ("b", 1.0)))
    await asyncio.sleep(0)
    assert queue.num_waiting == 21
    await grant(queue, 2, clock)
    await later
    await grant(queue, 20, clock)
    await asyncio.gather(*tasks)


async def test_without_early_refusal_or_a_measured_rate_a_request_waits():
    clock = FakeClock()
    queue = RequestQueue(max_running=1, refuse_early=False, clock=clock)
    await queue.acquire(5, 1)
    tasks = await queued(queue, 30, ("a", 1.0))
    await grant(queue, 10, clock)
    waiter = asyncio.create_task(queue.acquire(5, 1.0, ("a", 1.0)))
    await asyncio.sleep(0)
    assert queue.num_waiting == 21  # waits, to leave at its deadline
    waiter.cancel()
    fresh = RequestQueue(max_running=1, clock=clock)  # no turns granted yet: nothing to predict from
    await fresh.acquire(5, 1)
    assert fresh.drain_rate() is None
    fresh_waiter = asyncio.create_task(fresh.acquire(5, 0.001, ("a", 1.0)))
    with pytest.raises(asyncio.TimeoutError):  # waited (and left at its latest start), not refused at once
        await fresh_waiter
    await grant(queue, 21, clock)
    await asyncio.gather(*tasks, waiter, return_exceptions=True)
