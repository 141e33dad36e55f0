"""The real decode engine in-process (no server): what a request sees when the engine itself fails."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kv_transfer.base import TransferredKv
from worker.torch_engine.build import paged_pool
from worker.torch_engine.decode_engine import DecodeEngine
from worker.engine.errors import RequestFailed, SequencePreempted
from worker.engine.media import MediaSpan
from worker.torch_engine.model_runner import ModelRunner
from worker.engine.sequence import DecodeState, SamplingParams

PROMPT = list(range(3, 12))


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    return ModelRunner(model_dir)


def prompt_kv(runner: ModelRunner, request_id: str) -> TransferredKv:
    shape = runner.kv_shape(len(PROMPT))
    layers = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(runner.num_layers)]
    return TransferredKv(request_id, layers, first_token_id=5, prefill_time_ms=1.0)


async def test_a_failed_decode_step_fails_its_requests_as_a_worker_fault_and_the_engine_keeps_running(
        runner, monkeypatch):
    engine = DecodeEngine(runner, paged_pool(runner, 1000))
    engine.start()
    try:
        def broken_step(rows, chunks, on_layer=None):
            raise RuntimeError("device lost")

        monkeypatch.setattr(runner, "forward", broken_step)
        handle = engine.register("r1", len(PROMPT), SamplingParams(max_tokens=4, ignore_eos=True), 64, PROMPT)
        await engine.admit(handle)
        engine.on_kv(prompt_kv(runner, "r1"))
        first = await asyncio.wait_for(handle.events.get(), 10)
        assert first.token_id == 5
        failure = await asyncio.wait_for(handle.events.get(), 10)
        # RequestFailed is INTERNAL on the wire: the coordinator blames this decode worker, not the prefill one.
        assert isinstance(failure, RequestFailed) and "decode step failed" in str(failure)
        assert handle.state is DecodeState.FAILED
        engine.release("r1")
        assert engine.admission.budget.used == 0

        monkeypatch.undo()
        handle = engine.register("r2", len(PROMPT), SamplingParams(max_tokens=4, ignore_eos=True), 64, PROMPT)
        await engine.admit(handle)
        engine.on_kv(prompt_kv(runner, "r2"))
        outputs = [await asyncio.wait_for(handle.events.get(), 10) for _ in range(4)]
        assert [o.index for o in outputs] == [0, 1, 2, 3] and outputs[-1].finish_reason is not None
        engine.release("r2")
    finally:
        engine.shutdown()


async def test_each_step_hands_all_its_tokens_to_the_event_loop_in_one_call(runner, monkeypatch):
    engine = DecodeEngine(runner, paged_pool(runner, 1000))
    handoffs = []
    deliver_all = engine._deliver_all

    def record(items):
        handoffs.append(sorted((rid, out.index) for rid, out in items))
        deliver_all(items)

    monkeypatch.setattr(engine, "_deliver_all", record)
    handles = []
    for rid in "abcd":  # all four caches are in the inbox before the engine starts: they join the same step
        handle = engine.register(rid, len(PROMPT), SamplingParams(max_tokens=3, ignore_eos=True), 64, PROMPT)
        await engine.admit(handle)
        engine.on_kv(prompt_kv(runner, rid))
        handles.append(handle)
    engine.start()
    try:
        for handle in handles:
            outputs = [await asyncio.wait_for(handle.events.get(), 10) for _ in range(3)]
            assert [o.index for o in outputs] == [0, 1, 2] and outputs[-1].finish_reason is not None
        # The arrived caches' first tokens in one hand-off, then one per step.
        assert handoffs == [[(rid, index) for rid in "abcd"] for index in range(3)]
    finally:
        for rid in "abcd":
            engine.release(rid)
        engine.shutdown()


async def run_local(engine: DecodeEngine, rid: str, prompt: list[int], max_tokens: int) -> list[int]:
    handle = engine.register(rid, len(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), 512, prompt)
    await engine.admit(handle)
    engine.prefill_locally(handle)
    tokens = []
    while True:
        out = await asyncio.wait_for(handle.events.get(), 30)
        assert not isinstance(out, Exception), out
        tokens.append(out.token_id)
        if out.finish_reason is not None:
            engine.release(rid)
            return tokens


async def test_sequences_preempted_when_the_pool_runs_dry_resume_with_the_tokens_they_would_have_had(
        model_dir, hf_model):
    runner = ModelRunner(model_dir)
    engine = DecodeEngine(runner, paged_pool(runner, 6 * 16), max_prefill_tokens=7)  # 6 blocks; chunks of 7
    free_at_start = engine.pool.num_free
    prompts = [[(7 * i + 3 * t) % 900 + 5 for t in range(20)] for i in range(3)]
    engine.start()
    try:
        # Each ends at 20 + 60 positions: 5 blocks. Three of them outgrow the 6-block pool many times over.
        got = await asyncio.gather(*(run_local(engine, f"r{i}", p, 60) for i, p in enumerate(prompts)))
    finally:
        engine.shutdown()
    assert engine.scheduler.num_preemptions > 0
    with torch.inference_mode():
        want = [hf_model[0].generate(torch.tensor([p]), max_new_tokens=60, do_sample=False,
                                     min_new_tokens=60)[0, 20:].tolist() for p in prompts]
    assert got == want
    assert engine.pool.num_free == free_at_start and engine.admission.budget.used == 0


async def test_a_long_local_prefill_is_chunked_into_decode_steps_that_keep_the_running_sequences_moving(
        model_dir, hf_model, monkeypatch):
    runner = ModelRunner(model_dir)
    engine = DecodeEngine(runner, paged_pool(runner, 4096), max_prefill_tokens=32)
    steps = []
    step = engine._step

    def record(batch, chunks):
        steps.append(([s.request_id for s in batch], [(c.work.seq.request_id, c.num_tokens) for c in chunks]))
        step(batch, chunks)

    monkeypatch.setattr(engine, "_step", record)
    short, long = [5, 6, 7, 8], [(11 * t) % 900 + 5 for t in range(300)]
    engine.start()
    try:
        running = asyncio.ensure_future(run_local(engine, "running", short, 60))
        while not any("running" in batch for batch, _ in steps):
            await asyncio.sleep(0.01)
        got = await run_local(engine, "long", long, 3)
        await running
    finally:
        engine.shutdown()
    with torch.inference_mode():
        want = hf_model[0].generate(torch.tensor([long]), max_new_tokens=3, do_sample=False)[0, 300:].tolist()
    assert got == want
    prefilling = [(batch, chunks) for batch, chunks in steps if any(rid == "long" for rid, _ in chunks)]
    assert len(prefilling) >= 300 // 32  # chunks of at most 32 tokens, one per step
    assert all(n <= 32 for _, chunks in prefilling for _, n in chunks)
    assert all("running" in batch for batch, _ in prefilling[:-1])  # decoding went on through every chunk


async def test_a_sequence_whose_images_stayed_on_the_prefill_worker_moves_on_when_the_pool_runs_dry(runner):
    engine = DecodeEngine(runner, paged_pool(runner, 4 * 16))  # 4 blocks; each sequence grows to 4 (9 + 40 positions)
    image = MediaSpan("image", 1234, 2, 4)  # known by identity only: its cache came from a prefill worker
    handles = []
    for rid in ("old", "young"):
        handle = engine.register(rid, len(PROMPT), SamplingParams(max_tokens=40, ignore_eos=True), 64, PROMPT,
                                 media=(image,))
        await engine.admit(handle)
        engine.on_kv(prompt_kv(runner, rid))
        handles.append(handle)
    engine.start()
    try:
        async def events(handle) -> list:
            out = []
            while not out or not (isinstance(out[-1], Exception) or out[-1].finish_reason is not None):
                out.append(await asyncio.wait_for(handle.events.get(), 30))
            return out

        old, young = await asyncio.gather(*(events(h) for h in handles))
        # The younger cannot be recomputed here, so it ends for the coordinator to continue it elsewhere (ABORTED,
        # FAILURE_REASON_PREEMPTED on the wire); the older one runs to its end.
        assert isinstance(young[-1], SequencePreempted) and "images stayed with the prefill worker" in str(young[-1])
        assert len(old) == 40 and old[-1].finish_reason is not None
    finally:
        for rid in ("old", "young"):
            engine.release(rid)
        engine.shutdown()
