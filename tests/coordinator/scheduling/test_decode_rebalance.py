"""Decode rebalancing's choices (which streams move, how many), its interruption of a relaying task, and streams
moving to a decode worker that joins (real processes)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import time

import httpx
import pytest

from coordinator.errors import WorkerError
from coordinator.metrics import NullMetrics
from coordinator.requests.attempt import AttemptFailed, AttemptRunner, Progress, TokenRelay, _Deadlines
from coordinator.requests.request import GenerationRequest, GuidedGrammar, SamplingOptions
from coordinator.scheduling.decode_rebalance import (DecodeRebalancer, MovableStream, RebalanceConfig, can_move,
                                                     pick_moves)
from coordinator.scheduling.router import Placement
from coordinator.workers.instances import InstanceRegistry
from proto import worker_pb2 as pb
from tests.helpers import (instance_states, management_url, scrape, start_coordinator, start_worker, wait_for,
                           wait_until, write_config)

CONFIG = RebalanceConfig(enabled=True, min_imbalance=4, min_tokens_left=64, max_moves=8)


def stream(address: str, sent: int, end: int) -> MovableStream:
    return MovableStream(Progress(token_ids=[0] * sent), end, address)


async def test_streams_move_off_the_busiest_until_the_gap_is_under_min_imbalance():
    crowded = [stream("a", 10, 300 + i) for i in range(8)]
    moves = pick_moves({"a": 8, "b": 0}, {"a": crowded}, CONFIG)
    # 8/0 -> 7/1 -> 6/2 -> 5/3: a gap of 2 is under 4.
    assert len(moves) == 3
    assert [m.tokens_left for m in moves] == [297, 296, 295]  # the most tokens still to make first


async def test_an_instance_whose_streams_may_not_move_leaves_the_moves_to_the_next_busiest():
    pinned = [stream("a", 290, 300) for _ in range(9)]  # all near their end
    moves = pick_moves({"a": 9, "b": 9, "c": 0}, {"a": pinned, "b": [stream("b", 0, 300) for _ in range(9)]}, CONFIG)
    assert len(moves) == 3 and {m.address for m in moves} == {"b"}  # 9/9/0 -> 9/6/3


async def test_a_gap_under_min_imbalance_moves_nothing():
    assert pick_moves({"a": 5, "b": 2}, {"a": [stream("a", 0, 300) for _ in range(5)]}, CONFIG) == []


async def test_a_busiest_instance_with_less_than_twice_the_least_busy_ones_requests_keeps_its_streams():
    # New requests go to the least busy: a gap this small evens out without a move's prefill.
    assert pick_moves({"a": 11, "b": 6}, {"a": [stream("a", 0, 300) for _ in range(11)]}, CONFIG) == []
    assert len(pick_moves({"a": 12, "b": 5}, {"a": [stream("a", 0, 300) for _ in range(12)]}, CONFIG)) == 1


async def test_streams_near_their_end_told_already_or_on_another_instance_stay():
    short = stream("a", 250, 300)  # 50 left, under min_tokens_left
    told = stream("a", 0, 300)
    told.wanted = True
    assert pick_moves({"a": 9, "b": 0}, {"a": [short, told]}, CONFIG) == []


async def test_moves_in_one_round_stop_at_max_moves_and_spread_over_the_quiet_instances():
    crowded = [stream("a", 0, 500) for _ in range(30)]
    config = CONFIG.model_copy(update={"max_moves": 5})
    assert len(pick_moves({"a": 30, "b": 0, "c": 0}, {"a": crowded}, config)) == 5
    loads = {"a": 12, "b": 0, "c": 0}
    moves = pick_moves(loads, {"a": [stream("a", 0, 500) for _ in range(12)]}, CONFIG)
    assert len(moves) == 6 and loads == {"a": 12, "b": 0, "c": 0}  # 12/0/0 -> 6/3/3; the caller's loads kept


async def test_a_rebalancer_round_tells_the_chosen_streams_of_routable_decode_instances_only():
    registry = InstanceRegistry([], ["a:1", "b:1", "gone:1"])
    by_address = {i.address: i for i in registry.instances("decode")}
    by_address["a:1"].outstanding_requests = 6
    by_address["gone:1"].outstanding_requests = 9
    registry.record_failure(by_address["gone:1"], "test", gone=True)
    rebalancer = DecodeRebalancer(CONFIG, registry)
    streams = [rebalancer.relaying(Progress(), 300, "a:1") for _ in range(6)]
    stranded = [rebalancer.relaying(Progress(), 300, "gone:1") for _ in range(9)]
    assert rebalancer.round() == 2  # 6/0 -> 5/1 -> 4/2
    assert sum(s.wanted for s in streams) == 2 and not any(s.wanted for s in stranded)
    for s in streams + stranded:
        rebalancer.done(s)
    assert rebalancer.streams == {}


def test_only_streams_a_continuation_gives_unchanged_are_movable():
    plain = GenerationRequest("r", [1, 2, 3], SamplingOptions())
    assert can_move(plain)
    assert can_move(dataclasses.replace(plain, sampling=SamplingOptions(seed=7, seed_drawn=True)))
    for sampling in (SamplingOptions(stop=("END",)), SamplingOptions(presence_penalty=0.5),
                     SamplingOptions(frequency_penalty=0.5), SamplingOptions(seed=7),
                     SamplingOptions(guided=GuidedGrammar("start: /a+/"))):
        assert not can_move(dataclasses.replace(plain, sampling=sampling)), sampling


async def reading_task() -> tuple[asyncio.Task, MovableStream]:
    """A task waiting on a read as a relay does: a move's cancellation is its "moved", any other goes on."""
    read = asyncio.get_running_loop().create_future()
    handles: list[MovableStream] = []

    async def relay():
        moving = MovableStream(Progress(), 300, "a")
        handles.append(moving)
        moving.reading()
        try:
            await read
        except asyncio.CancelledError:
            if moving.interrupted():
                return "moved", asyncio.current_task().cancelling()
            raise

    task = asyncio.create_task(relay())
    await wait_until(lambda: handles)
    return task, handles[0]


async def test_a_move_interrupts_a_task_waiting_on_its_stream_and_the_cancellation_is_taken_back():
    task, moving = await reading_task()
    assert moving.move()
    assert await task == ("moved", 0) and not task.cancelled()


async def test_a_move_told_while_the_task_writes_to_its_client_waits_for_its_next_read():
    writing = asyncio.Event()
    handles: list[MovableStream] = []

    async def relay():
        moving = MovableStream(Progress(), 300, "a")
        handles.append(moving)
        await writing.wait()  # not reading: a move must not cancel this
        return moving.wanted

    task = asyncio.create_task(relay())
    await asyncio.sleep(0)
    handles[0].move()
    writing.set()
    assert await task is True


async def test_a_cancellation_of_its_own_during_a_move_still_cancels_the_task():
    task, moving = await reading_task()
    moving.move()
    task.cancel()  # the client left at the same moment
    with pytest.raises(asyncio.CancelledError):
        await task


MAX_TOKENS = 800  # long enough that the streams still run when the second decode worker joins
LONG = {"maxIterTimes": MAX_TOKENS, "maxSeqLen": 2048, "maxInputTokenLen": 2048}


@pytest.mark.system
def test_streams_crowding_one_decode_worker_move_to_one_that_joins_and_finish_unchanged(model_dir, tmp_path):
    sections = {"health_config": {"check_interval_s": 0.3, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 60},
                "digs_scheduler_config": {"algorithm_type": "load_balance"},
                "rebalance_config": {"enabled": True, "interval_s": 0.2, "min_imbalance": 4}}
    coordinator = start_coordinator(write_config(tmp_path / "c.json", [], [], model_dir, sections, **LONG))
    manage = management_url(coordinator)
    prefill = start_worker("prefill", model_dir, "--coordinator", manage)
    crowded = start_worker("decode", model_dir, "--coordinator", manage)
    spare = start_worker("decode", model_dir)  # joins once the streams run on the other
    prompts = [f"Story {i}: once upon a time" for i in range(8)]

    def decode_load() -> dict[str, int]:
        listed = httpx.get(f"{manage}/v1/instances", timeout=10).json()["decode"]
        return {i["address"]: i["outstanding_requests"] for i in listed}

    def generate(prompt: str, stream: bool = False) -> tuple[list[int], str]:
        """Its token ids and text; streamed, as the chunks brought them (tokens from the frames to the client)."""
        body = {"model": "pdserve-tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "stream": stream}
        if not stream:
            reply = httpx.post(f"{coordinator.address}/v1/completions", timeout=180, json=body)
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            return choice["token_ids"], choice["text"]
        with httpx.stream("POST", f"{coordinator.address}/v1/completions", timeout=180, json=body) as reply:
            assert reply.status_code == 200
            chunks = [json.loads(line[6:]) for line in reply.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert not any("error" in chunk for chunk in chunks), chunks[-1]
        choices = [chunk["choices"][0] for chunk in chunks if chunk["choices"]]
        return [t for c in choices for t in c.get("token_ids") or ()], "".join(c["text"] for c in choices)

    try:
        wait_for(lambda: instance_states(coordinator)["decode"] and instance_states(coordinator)["prefill"],
                 what="both workers registered")
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            uninterrupted = list(pool.map(generate, prompts))
            streams = [pool.submit(generate, prompt, i % 2 == 0) for i, prompt in enumerate(prompts)]
            wait_for(lambda: decode_load() == {crowded.address: 8}, timeout_s=60, what="8 streams on one worker")
            assert scrape(coordinator.address)[("pdserve_request_rebalances_total", ())] == 0  # nowhere to go yet
            joined = httpx.post(f"{manage}/v1/instances/register", timeout=10,
                                json={"role": "decode", "address": spare.address})
            assert joined.status_code == 200, joined.text
            # 8/0 -> 5/3 (a gap under min_imbalance): the new worker takes streams it was never routed.
            wait_for(lambda: decode_load().get(spare.address, 0) >= 3, timeout_s=60, what="streams moved")
            outputs = [stream.result(timeout=180) for stream in streams]
        # Greedy, resumed from the prompt and the tokens sent: the same tokens and text, streamed or not.
        assert outputs == uninterrupted
        counters = scrape(coordinator.address)
        assert 3 <= counters[("pdserve_request_rebalances_total", ())] <= 4
        assert counters[("pdserve_request_migrations_total", ())] == 0  # a move is not a migration
    finally:
        for process in (prefill, crowded, spare, coordinator):
            process.stop()


async def test_tokens_reaching_a_stream_told_to_move_are_left_to_its_task():
    taken = []
    moving = MovableStream(Progress(), 300, "a")
    take = moving.guard(lambda token: taken.append(token) or True)
    assert take("t1") is True
    assert moving.move()
    assert take("t2") is False and taken == ["t1"]  # the task leaves without it: the continuation makes it again


class QueueStream:
    """A decode stream's reads, fed by the test: the relay under test, not a worker."""

    def __init__(self):
        self.events: asyncio.Queue = asyncio.Queue()

    async def read(self):
        return await self.events.get()


async def test_a_stream_told_to_move_mid_character_stays_until_its_text_is_whole():
    registry = InstanceRegistry([], ["d:1"])
    decode = registry.get("decode", "d:1")
    runner = AttemptRunner(None, registry, None, 60.0, NullMetrics())
    progress, stream = Progress(), QueueStream()
    relay = TokenRelay(NullMetrics(), decode, progress, False, 0.0, time.monotonic())
    clocks = _Deadlines(60.0, time.monotonic() + 60, WorkerError("late"))
    relayed, handles = [], []

    async def run():
        moving = MovableStream(progress, 100, "d:1")
        handles.append(moving)
        first = pb.TokenEvent(token_id=1, text="a", index=0)
        async for delta in runner._relay(stream, first, Placement(None, decode), 3, relay, clocks, None, moving):
            relayed.append(delta.text)

    task = asyncio.create_task(run())
    # The first byte of a two-byte character: its worker sends no text for it yet.
    await stream.events.put(pb.TokenEvent(token_id=2, text="", index=1))
    await wait_until(lambda: len(relayed) == 2 and handles[0]._reading)
    assert not handles[0].move() and not handles[0].wanted  # declined: the task reads on
    await stream.events.put(pb.TokenEvent(token_id=3, text="é", index=2))
    await wait_until(lambda: len(relayed) == 3 and handles[0]._reading)
    assert handles[0].move()
    with pytest.raises(AttemptFailed) as moved:
        await task
    assert moved.value.rebalanced and moved.value.blame is decode
    assert relayed == ["a", "", "é"] and progress.token_ids == [1, 2, 3]
    held = MovableStream(Progress(token_ids=[1], held_text_tokens=1), 300, "b")
    assert pick_moves({"a": 0, "b": 9}, {"b": [held]}, CONFIG) == []  # no candidate while mid-character
