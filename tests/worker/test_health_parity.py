"""Real and simulated engines count their queues the same way: one Health, whatever the backend.

Both engines are built in-process and not started; the test turns the real engine thread's crank
itself, so every queue holds exactly what the test put there.
"""

from __future__ import annotations

import asyncio
import pytest
import torch

from kv_transfer.base import TransferredKv
from proto import worker_pb2 as pb
from worker.engine.block_pool import BlockPool
from worker.torch_engine.build import paged_pool
from worker.torch_engine.decode_engine import DecodeEngine
from worker.torch_engine.model_runner import ModelRunner
from worker.torch_engine.prefill_engine import PrefillEngine
from worker.engine.sequence import DecodeState, SamplingParams
from worker.service.servicers import load_to_pb
from worker.simulated.cost_model import CostModel, KvShape
from worker.simulated.decode_engine import SimulatedDecodeEngine
from worker.simulated.kv import VerifiedKv
from worker.simulated.prefill_engine import SimulatedPrefillEngine

PROMPT_LEN, MAX_TOKENS, MAX_SEQ_LEN = 10, 10, 512
BLOCK = 16
RESERVATION = BLOCK  # admission holds the prompt and its first token, in whole blocks; later tokens take blocks
PROMPT_BLOCKS = BLOCK  # a prefill worker holds whole blocks of its prompt
PROMPT = list(range(3, 3 + PROMPT_LEN))
SAMPLING = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
EXPECTED_STATES = {
    "waits-for-kv": DecodeState.WAITING_FOR_KV, "prefills-here": DecodeState.PREFILLING_LOCALLY,
    "decodes": DecodeState.DECODING, "waits-for-seat": DecodeState.DECODING,
    "waits-for-budget": DecodeState.WAITING_FOR_BUDGET,
}


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    return ModelRunner(model_dir)


def real_kv(runner: ModelRunner, request_id: str) -> TransferredKv:
    shape = runner.kv_shape(PROMPT_LEN)
    layers = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(runner.num_layers)]
    return TransferredKv(request_id, layers, first_token_id=5, prefill_time_ms=1.0)


def simulated_kv(request_id: str) -> VerifiedKv:
    return VerifiedKv(request_id, PROMPT_LEN, num_bytes=1, first_token_id=5, prefill_time_ms=1.0)


def without_model(health: pb.HealthResponse) -> pb.HealthResponse:
    health.model = ""
    return health


async def fill_decode_queues(engine, make_kv, step_intake) -> tuple[dict, asyncio.Future]:
    """The same calls on either engine: one request per place a decode request can wait or run."""

    async def admitted(request_id: str):
        handle = engine.register(request_id, PROMPT_LEN, SAMPLING, MAX_SEQ_LEN, PROMPT)
        await engine.admit(handle)
        return handle

    handles = {rid: await admitted(rid) for rid in ("waits-for-kv", "prefills-here", "decodes", "waits-for-seat")}
    engine.prefill_locally(handles["prefills-here"])
    engine.on_kv(make_kv("decodes"))
    engine.on_kv(make_kv("waits-for-seat"))
    handles["waits-for-budget"] = engine.register("waits-for-budget", PROMPT_LEN, SAMPLING, MAX_SEQ_LEN, PROMPT)
    in_line = asyncio.ensure_future(engine.admit(handles["waits-for-budget"]))
    step_intake()
    engine.scheduler.schedule(lambda seq: None)  # max_running=1: one sequence runs, the other waits for a seat
    await asyncio.sleep(0)  # lets the first tokens and the line's entry land
    return handles, in_line


async def test_real_and_simulated_decode_workers_report_the_same_health_for_the_same_queue(runner):
    budget = 4 * BLOCK  # four requests' reservations (a block each) fit; the fifth waits in line
    real = DecodeEngine(runner, paged_pool(runner, budget, BLOCK), max_running=1)
    simulated = SimulatedDecodeEngine(CostModel(), BlockPool(1 + budget // BLOCK, BLOCK), max_running=1)

    def real_intake():
        real._loop = asyncio.get_running_loop()  # its thread never starts: the test does its intake
        real._drain_inbox(block=False)

    real_handles, real_line = await fill_decode_queues(real, lambda rid: real_kv(runner, rid), real_intake)
    sim_handles, sim_line = await fill_decode_queues(simulated, simulated_kv, lambda: None)
    try:
        assert {rid: h.state for rid, h in real_handles.items()} == EXPECTED_STATES
        assert {rid: h.state for rid, h in sim_handles.items()} == EXPECTED_STATES
        real_health = load_to_pb(real.load(), draining=False)
        sim_health = load_to_pb(simulated.load(), draining=False)
        assert (real_health.num_running, real_health.num_waiting) == (1, 4)  # waiting: budget, KV, prefill, seat
        assert (real_health.kv_used_tokens, real_health.kv_capacity_tokens) == (4 * RESERVATION, budget)
        assert without_model(real_health) == without_model(sim_health)
    finally:
        for engine, line in ((real, real_line), (simulated, sim_line)):
            line.cancel()
            await asyncio.gather(line, return_exceptions=True)
            for rid in EXPECTED_STATES:
                engine.release(rid)
            assert engine.load().kv_used_tokens == 0


async def test_real_and_simulated_prefill_workers_report_the_same_health_for_the_same_queue(runner):
    budget = 2 * PROMPT_BLOCKS + BLOCK // 2  # two prompts' blocks fit; the third waits in line
    real = PrefillEngine(runner, paged_pool(runner, budget, BLOCK))
    simulated = SimulatedPrefillEngine(CostModel(), KvShape(), BlockPool(1 + budget // BLOCK, BLOCK))
    healths, pending = [], []
    for engine in (real, simulated):
        jobs = [await engine.submit(f"p{i}", PROMPT, SAMPLING) for i in range(2)]
        line = asyncio.ensure_future(engine.submit("in-line", PROMPT, SAMPLING))
        await asyncio.sleep(0)
        healths.append(load_to_pb(engine.load(), draining=False))
        pending.append((engine, jobs, line))
    for engine, jobs, line in pending:
        line.cancel()
        await asyncio.gather(line, return_exceptions=True)
        for job in jobs:
            engine.release(job)
    real_health, sim_health = healths
    assert (real_health.num_running, real_health.num_waiting, real_health.num_kv_leases) == (0, 3, 2)
    assert (real_health.kv_used_tokens, real_health.queued_prompt_tokens) == (2 * PROMPT_BLOCKS, 2 * PROMPT_LEN)
    assert without_model(real_health) == without_model(sim_health)
