"""Scheduling and budget bookkeeping, without a model."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from worker.engine.kv_budget import KvAdmission, KvBudget, KvCapacityError
from worker.engine.scheduler import DecodeScheduler, PrefillScheduler
from worker.engine.sequence import SamplingParams, Sequence


@dataclass(eq=False)
class Prompt:
    name: str
    num_tokens: int


def make_prompts(*lengths: int) -> list[Prompt]:
    return [Prompt(f"p{i}", n) for i, n in enumerate(lengths)]


def test_prefill_batches_prompts_within_the_padded_token_budget():
    sched = PrefillScheduler(max_batch_tokens=100, max_batch_size=8)
    for p in make_prompts(10, 20, 30, 40):
        sched.add(p)
    assert [p.num_tokens for p in sched.next_batch()] == [10, 20, 30]  # 3 x 30 padded = 90
    assert [p.num_tokens for p in sched.next_batch()] == [40]


def test_prefill_batch_size_is_capped():
    sched = PrefillScheduler(max_batch_tokens=10_000, max_batch_size=2)
    for p in make_prompts(5, 5, 5):
        sched.add(p)
    assert len(sched.next_batch()) == 2 and len(sched.next_batch()) == 1


def test_long_prompt_at_the_head_runs_alone_and_is_never_starved():
    sched = PrefillScheduler(max_batch_tokens=100, max_batch_size=8)
    for p in make_prompts(500, 10, 10):
        sched.add(p)
    assert [p.num_tokens for p in sched.next_batch()] == [500]
    assert [p.num_tokens for p in sched.next_batch()] == [10, 10]


def test_short_prompts_pass_a_long_one_that_does_not_fit_this_batch():
    sched = PrefillScheduler(max_batch_tokens=100, max_batch_size=8)
    for p in make_prompts(10, 90, 10, 10):
        sched.add(p)
    assert [p.num_tokens for p in sched.next_batch()] == [10, 10, 10]
    assert [p.num_tokens for p in sched.next_batch()] == [90]


def test_decode_scheduler_admits_up_to_max_running_and_frees_at_once():
    sched = DecodeScheduler(max_running=2)
    seqs = [Sequence(str(i), 4, SamplingParams(), 100) for i in range(3)]
    for s in seqs:
        sched.add(s)
    joined, batch = sched.schedule()
    assert joined == seqs[:2] and batch == seqs[:2]
    sched.finish(seqs[0])
    joined, batch = sched.schedule()
    assert joined == [seqs[2]] and batch == [seqs[1], seqs[2]]


def test_budget_refuses_what_does_not_fit():
    budget = KvBudget(100)
    budget.allocate("a", 60)
    assert not budget.can_allocate(41)
    with pytest.raises(KvCapacityError):
        budget.allocate("b", 41)
    assert budget.free("a") == 60 and budget.used == 0
    assert budget.free("a") == 0


async def test_admission_is_first_come_first_served():
    admission = KvAdmission(KvBudget(100))
    await admission.acquire("a", 80)
    order = []

    async def wait(rid, tokens):
        await admission.acquire(rid, tokens)
        order.append(rid)

    tasks = [asyncio.create_task(wait("b", 50)), asyncio.create_task(wait("c", 10))]
    await asyncio.sleep(0.01)
    assert order == [] and admission.num_waiting == 2  # c fits now but must not pass b
    admission.release("a")
    await asyncio.gather(*tasks)
    assert order == ["b", "c"] and admission.budget.used == 60


async def test_admission_refuses_at_once_what_can_never_fit():
    admission = KvAdmission(KvBudget(100))
    with pytest.raises(KvCapacityError, match="whole budget is 100 tokens"):
        await admission.acquire("big", 101)


async def test_cancelled_waiter_leaves_the_line_and_holds_nothing():
    admission = KvAdmission(KvBudget(100))
    await admission.acquire("a", 100)
    task = asyncio.create_task(admission.acquire("b", 50))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    admission.release("a")
    assert admission.num_waiting == 0 and admission.budget.used == 0


async def test_budget_released_before_a_cancelled_waiter_runs_skips_that_waiter():
    admission = KvAdmission(KvBudget(100))
    await admission.acquire("a", 100)
    cancelled = asyncio.create_task(admission.acquire("b", 50))
    waiting = asyncio.create_task(admission.acquire("c", 50))
    await asyncio.sleep(0.01)
    cancelled.cancel()
    admission.release("a")  # before `cancelled` has run to leave the line
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await waiting
    assert admission.num_waiting == 0 and admission.budget.used == 50
