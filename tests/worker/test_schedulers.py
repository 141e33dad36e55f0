"""Scheduling and budget bookkeeping, without a model."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from tests.helpers import wait_until
from worker.engine.media import MediaSpan
from worker.engine.block_pool import BlockPool, BlockTable
from worker.engine.kv_budget import KvAdmission, KvBudget, KvCapacityError
from worker.engine.scheduler import DecodeScheduler, PrefillScheduler
from worker.engine.sequence import SamplingParams, Sequence


@dataclass(eq=False)
class Prompt:
    """A PromptWork: tokens to compute into KV blocks."""

    token_ids: list[int]
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0
    started: bool = False
    cached_tokens: int = 0
    extra_positions: int = 0
    media: tuple = ()
    prepared_media: None = None
    lora: None = None
    prompt_logprobs: int | None = None

    @property
    def cache_token_ids(self) -> list[int]:
        return self.token_ids


def distinct_prompts(*lengths: int) -> list[Prompt]:
    return [Prompt([1000 * (i + 1) + t for t in range(n)]) for i, n in enumerate(lengths)]


def chunk_sizes(chunks) -> list[tuple[int, int]]:
    return [(c.start, c.end) for c in chunks]


def test_prefill_fills_a_forward_with_whole_prompts_and_a_chunk_of_the_next_within_the_token_budget():
    sched = PrefillScheduler(BlockPool(64, 16), max_batch_tokens=100, max_batch_size=8)
    prompts = distinct_prompts(10, 20, 30, 80)
    for p in prompts:
        sched.add(p)
    first = sched.next_chunks()
    assert chunk_sizes(first) == [(0, 10), (0, 20), (0, 30), (0, 40)]  # packed: no padding, the last one cut
    assert sched.computed(first) == prompts[:3]
    assert chunk_sizes(sched.next_chunks()) == [(40, 80)]


def test_prefill_batch_size_is_capped():
    sched = PrefillScheduler(BlockPool(64, 16), max_batch_tokens=10_000, max_batch_size=2)
    for p in distinct_prompts(5, 5, 5):
        sched.add(p)
    first = sched.next_chunks()
    assert len(first) == 2
    sched.computed(first)
    assert len(sched.next_chunks()) == 1


def test_a_long_prompt_at_the_head_is_cut_into_budget_sized_chunks_and_never_starved():
    sched = PrefillScheduler(BlockPool(64, 16), max_batch_tokens=100, max_batch_size=8)
    long, short = distinct_prompts(250, 10)
    sched.add(long)
    sched.add(short)
    seen = []
    while sched.queue:
        chunks = sched.next_chunks()
        seen.append([(p is long, c.start, c.end) for c in chunks for p in [c.work]])
        sched.computed(chunks)
    assert seen == [[(True, 0, 100)], [(True, 100, 200)], [(True, 200, 250), (False, 0, 10)]]


def test_a_prompt_whose_leading_blocks_are_cached_starts_at_its_first_uncached_token():
    pool = BlockPool(64, 16)
    sched = PrefillScheduler(pool, max_batch_tokens=1000)
    shared = list(range(100, 140))  # 2 full blocks and 8 tokens
    first = Prompt(shared + [1, 2, 3])
    sched.add(first)
    sched.computed(sched.next_chunks())
    pool.release(first.table)  # its lease ended: full blocks stay cached
    again, other = Prompt(shared + [7, 8]), Prompt([5] * 40)
    sched.add(again)
    sched.add(other)
    assert chunk_sizes(sched.next_chunks()) == [(32, 42), (0, 40)]
    assert again.cached_tokens == 32 and other.cached_tokens == 0


def test_a_fully_cached_prompt_still_computes_its_last_block_for_the_logits():
    pool = BlockPool(64, 16)
    sched = PrefillScheduler(pool, max_batch_tokens=1000)
    prompt = Prompt(list(range(32)))
    sched.add(prompt)
    sched.computed(sched.next_chunks())
    pool.release(prompt.table)
    again = Prompt(list(range(32)))
    sched.add(again)
    assert chunk_sizes(sched.next_chunks()) == [(16, 32)]


def test_a_prompt_waits_at_the_head_while_the_pool_cannot_hold_it():
    pool = BlockPool(5, 16)  # 4 usable blocks
    sched = PrefillScheduler(pool, max_batch_tokens=1000)
    holder, waiter = distinct_prompts(48, 32)
    sched.add(holder)
    sched.computed(sched.next_chunks())
    sched.add(waiter)
    assert sched.next_chunks() == [] and not waiter.started
    pool.release(holder.table)
    assert chunk_sizes(sched.next_chunks()) == [(0, 32)]


def decoding(rid: str, prompt_len: int, pool: BlockPool) -> Sequence:
    seq = Sequence(rid, prompt_len, SamplingParams(), 10_000, prompt_token_ids=[hash(rid) % 997 + t for t in range(prompt_len)])
    seq.output_token_ids.append(1)  # the first token, from the prefill
    return seq


def test_decode_scheduler_admits_up_to_max_running_and_frees_at_once():
    pool = BlockPool(64, 16)
    sched = DecodeScheduler(pool, max_running=2)
    seqs = [decoding(str(i), 4, pool) for i in range(3)]
    for s in seqs:
        sched.add(s)
    joined, batch = sched.schedule(lambda seq: None)
    assert joined == seqs[:2] and batch == seqs[:2]
    sched.finish(seqs[0])
    joined, batch = sched.schedule(lambda seq: None)
    assert joined == [seqs[2]] and batch == [seqs[1], seqs[2]]
    assert not seqs[0].table.block_ids  # its blocks went back at once


def test_a_running_sequence_takes_a_block_when_it_fills_one():
    pool = BlockPool(64, 16)
    sched = DecodeScheduler(pool)
    seq = decoding("a", 15, pool)
    sched.add(seq)
    sched.schedule(lambda s: None)
    assert seq.table.num_blocks == 1  # 16 positions: the prompt and the first token
    seq.output_token_ids.append(2)
    sched.schedule(lambda s: None)
    assert seq.table.num_blocks == 2


def test_when_the_pool_runs_dry_the_youngest_sequence_is_preempted_and_the_rest_keep_running():
    pool = BlockPool(4, 16)  # 3 usable blocks
    sched = DecodeScheduler(pool)
    old, young = decoding("old", 16, pool), decoding("young", 15, pool)
    sched.add(old)
    sched.add(young)
    _, batch = sched.schedule(lambda s: None)
    assert batch == [old, young] and pool.num_free == 0
    old.output_token_ids.append(2)  # needs a third block... already has 2 (17 positions); grow once more
    for _ in range(15):
        old.output_token_ids.append(3)
    preempted = []
    _, batch = sched.schedule(preempted.append)
    assert preempted == [young] and batch == [old]
    assert young.table.num_blocks == 0 and young.num_computed == 0
    assert sched.num_preemptions == 1


def test_a_sequence_whose_images_stayed_on_the_prefill_worker_is_preempted_only_when_no_other_can_be():
    pool = BlockPool(4, 16)  # 3 usable blocks
    sched = DecodeScheduler(pool)
    image = MediaSpan("image", 7, 0, 4)  # its identity only: the cache came from a prefill worker
    old, young = decoding("old", 16, pool), decoding("young", 15, pool)
    young.media = (image,)
    sched.add(old)
    sched.add(young)
    sched.schedule(lambda s: None)
    for _ in range(16):
        old.output_token_ids.append(3)
    preempted = []
    sched.schedule(preempted.append)
    assert preempted == [old]  # the older one can be recomputed here; the younger cannot
    assert not young.can_recompute and old.can_recompute


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
    await wait_until(lambda: admission.num_waiting + len(order) == 2, what="both to be in line or admitted")
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
    await wait_until(lambda: admission.num_waiting == 1, what="b in line")
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
    await wait_until(lambda: admission.num_waiting == 2, what="b and c in line")
    cancelled.cancel()
    admission.release("a")  # before `cancelled` has run to leave the line
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await waiting
    assert admission.num_waiting == 0 and admission.budget.used == 50
