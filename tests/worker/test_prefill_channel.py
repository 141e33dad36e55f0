"""Prefills on the prefill worker's token channel, against real simulated worker processes with the coordinator's
own WorkerClient: after a first Prefill call names the listener, a prefill is one frame each way, and answers and
fails as the Prefill call would."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from coordinator.requests.failures import FailureKind, WorkerCallError
from coordinator.requests.request import GenerationRequest, SamplingOptions
from coordinator.workers.client import DecodeAccepted, WorkerClient
from proto import worker_pb2 as pb
from tests.helpers import health, start_sim_worker, token_channel_opens, wait_for_idle, wait_until

pytestmark = pytest.mark.system

PROMPT = list(range(1, 10))


@pytest.fixture(scope="module")
def workers():
    prefill = start_sim_worker("prefill", "--metrics-port", "-1")
    decode = start_sim_worker("decode", "--metrics-port", "-1")
    yield prefill.address, decode.address
    assert prefill.stop() == 0
    assert decode.stop() == 0


@pytest.fixture(scope="module")
def slow_prefill():
    worker = start_sim_worker("prefill", "--metrics-port", "-1", "--sim-prefill-base-ms", "1500")
    yield worker.address
    assert worker.stop() == 0


def request(seed: int = 7, prompt: list[int] = PROMPT) -> GenerationRequest:
    return GenerationRequest(uuid.uuid4().hex, prompt, SamplingOptions(temperature=1.0, seed=seed), 6)


async def disaggregated(client: WorkerClient, prefill: str, decode: str, seed: int = 7):
    """One request prefilled on `prefill` and decoded on `decode`: the prefill's answer and the tokens."""
    req = request(seed)
    stream = client.open_decode(decode, req, 6, 512, 30)
    try:
        accepted = await stream.read()
        assert isinstance(accepted, DecodeAccepted)
        done = await client.prefill(prefill, req, 6, decode, 30, kv_data_address=accepted.kv_data_address,
                                    kv_transfer_token=accepted.kv_transfer_token,
                                    kv_layout_version=accepted.kv_layout_version)
        tokens = []
        while (token := await stream.read()) is not None:
            tokens.append(token.token_id)
            if token.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                return done.first_token_id, tokens
        raise AssertionError("the stream ended without a final token")
    finally:
        stream.cancel()


async def test_prefills_after_the_first_go_on_the_channel_and_get_what_a_prefill_call_gets(workers):
    prefill, decode = workers
    client = WorkerClient()
    try:
        by_call = await disaggregated(client, prefill, decode)  # its answer names the listener
        channel = await token_channel_opens(client, prefill)
        assert channel.role == "prefill"
        by_channel = await asyncio.gather(*(disaggregated(client, prefill, decode) for _ in range(8)))
        assert all(result == by_call for result in by_channel)
        assert not channel.sinks, "an answered prefill's sink stayed attached"
    finally:
        await client.close()


async def test_a_bad_prefill_on_the_channel_gets_the_status_a_prefill_call_gets(workers):
    prefill, decode = workers
    fresh, warm = WorkerClient(), WorkerClient()  # no channel yet / a channel open
    try:
        await disaggregated(warm, prefill, decode)
        await token_channel_opens(warm, prefill)
        failures = []
        for client in (fresh, warm):
            with pytest.raises(WorkerCallError) as failed:
                await client.prefill(prefill, request(prompt=[]), 6, decode, 30)
            failures.append(failed.value.failure)
        assert [(f.stage, f.code, f.details) for f in failures] == [("prefill", "INVALID_ARGUMENT",
                                                                     "prompt_token_ids is empty")] * 2
    finally:
        await fresh.close()
        await warm.close()


async def slow_prefill_running(client: WorkerClient, prefill: str, decode: str, timeout_s: float = 30):
    """A prefill under way on the slow worker's channel (its decode stream open), once the worker says it has it
    (or, with a deadline shorter than its 1.5 s, once it ended); both, to end by hand."""
    req = request()
    stream = client.open_decode(decode, req, 6, 512, 30)
    accepted = await stream.read()
    task = asyncio.create_task(client.prefill(prefill, req, 6, decode, timeout_s,
                                              kv_data_address=accepted.kv_data_address,
                                              kv_transfer_token=accepted.kv_transfer_token,
                                              kv_layout_version=accepted.kv_layout_version))

    async def taken() -> bool:
        h = await asyncio.to_thread(health, prefill, "prefill")
        return task.done() or h.num_running + h.num_waiting >= 1

    await wait_until(taken, what="the slow worker to take the prefill")
    return task, stream


async def test_a_lost_prefill_channel_fails_its_prefill_as_a_lost_prefill_worker_and_the_worker_frees_it(
        workers, slow_prefill):
    _, decode = workers
    client = WorkerClient()
    try:
        await disaggregated(client, slow_prefill, decode)
        channel = await token_channel_opens(client, slow_prefill)
        task, stream = await slow_prefill_running(client, slow_prefill, decode)
        assert not task.done()
        channel.close()
        with pytest.raises(WorkerCallError) as failed:
            await task
        failure = failed.value.failure
        assert (failure.stage, failure.code, failure.kind) == ("prefill", "UNAVAILABLE", FailureKind.WORKER_GONE)
        stream.cancel()
        await asyncio.to_thread(wait_for_idle, slow_prefill, "prefill")
    finally:
        await client.close()


async def test_a_prefill_past_its_deadline_or_cancelled_on_the_channel_is_freed_on_the_worker(workers, slow_prefill):
    _, decode = workers
    client = WorkerClient()
    try:
        await disaggregated(client, slow_prefill, decode)
        await token_channel_opens(client, slow_prefill)
        task, stream = await slow_prefill_running(client, slow_prefill, decode, timeout_s=0.6)
        with pytest.raises(WorkerCallError) as failed:
            await task
        # As a Prefill call past its deadline: a fault of the slow prefill worker, tried elsewhere.
        failure = failed.value.failure
        assert (failure.code, failure.details, failure.kind) == ("DEADLINE_EXCEEDED", "Deadline Exceeded",
                                                                 FailureKind.WORKER_FAULT)
        stream.cancel()
        await asyncio.to_thread(wait_for_idle, slow_prefill, "prefill")

        task, stream = await slow_prefill_running(client, slow_prefill, decode)
        assert not task.done()
        task.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await task
        stream.cancel()
        await asyncio.to_thread(wait_for_idle, slow_prefill, "prefill")
    finally:
        await client.close()
