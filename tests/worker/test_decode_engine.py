"""The real decode engine in-process (no server): what a request sees when the engine itself fails."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kv_transfer.base import TransferredKv
from worker.engine.decode_engine import DecodeEngine
from worker.engine.errors import RequestFailed
from worker.engine.model_runner import ModelRunner
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
    engine = DecodeEngine(runner, budget_tokens=1000)
    engine.start()
    try:
        def broken_step(batch):
            raise RuntimeError("device lost")

        monkeypatch.setattr(runner, "decode", broken_step)
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
