"""KV budgets read back to zero after every way a request can end, with real worker processes."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
import uuid

import grpc
import httpx
import pytest

from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from proto.failure_reason import reason_from_metadata
from tests.helpers import (fake_prompt_kv, health, open_decode_by_hand, start_coordinator, start_worker,
                           wait_for_idle, write_config)
from kv_transfer.codec import encode_kv

pytestmark = pytest.mark.system

LEASE_S = 2.0
DECODE_BUDGET = 288  # 18 blocks of 16


class BudgetCluster:
    def __init__(self, model_dir, tmp):
        self.model_dir = model_dir
        self.prefill = start_worker("prefill", model_dir, "--kv-lease-timeout", str(LEASE_S))
        self.decode = start_worker("decode", model_dir, "--kv-budget-tokens", str(DECODE_BUDGET),
                                   "--kv-trans-timeout", "3")
        self.coordinator = start_coordinator(write_config(tmp / "ms_coordinator.json", [self.prefill.address],
                                                          [self.decode.address], model_dir, maxIterTimes=400))
        self.url = self.coordinator.address

    def stop(self):
        for proc in (self.coordinator, self.prefill, self.decode):
            proc.stop()


@pytest.fixture(scope="module")
def bc(model_dir, tmp_path_factory):
    cluster = BudgetCluster(model_dir, tmp_path_factory.mktemp("budget"))
    yield cluster
    cluster.stop()


def complete(url: str, **fields) -> httpx.Response:
    body = {"model": "pdserve-tiny", "prompt": "Hello there", "temperature": 0, **fields}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_budget_is_zero_after_normal_completion(bc):
    for stream in (False, True):
        assert complete(bc.url, max_tokens=20, stream=stream).status_code == 200
    wait_for_idle(bc.prefill.address, "prefill")
    h = wait_for_idle(bc.decode.address, "decode")
    assert h.kv_capacity_tokens == DECODE_BUDGET


def test_client_disconnect_cancels_the_request_and_frees_its_kv(bc):
    body = {"model": "pdserve-tiny", "prompt": "Hello there", "max_tokens": 250, "stream": True, "temperature": 0}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{bc.url}/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            for _ in range(6):
                next(lines)
            assert health(bc.decode.address, "decode").num_running == 1
    wait_for_idle(bc.decode.address, "decode", timeout_s=5)
    wait_for_idle(bc.prefill.address, "prefill")


def test_request_that_can_never_fit_the_decode_pool_is_refused_naming_the_limit(bc):
    resp = complete(bc.url, max_tokens=DECODE_BUDGET)
    assert resp.status_code == 400
    assert f"whole pool holds {DECODE_BUDGET} tokens" in resp.json()["error"]["message"]
    wait_for_idle(bc.decode.address, "decode")
    assert complete(bc.url, max_tokens=3).json()["usage"]["completion_tokens"] == 3


def test_requests_that_outgrow_the_pool_together_are_preempted_and_resumed_with_the_same_tokens(bc):
    alone = complete(bc.url, max_tokens=200).json()["choices"][0]["text"]
    preempted_before = health(bc.decode.address, "decode").num_preemptions
    results = []

    def run():
        results.append(complete(bc.url, max_tokens=200))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Both fit when admitted (prompt blocks only) but not at 200 tokens each: the younger one was preempted,
    # recomputed once blocks came back, and resumed where it left off.
    assert [r.status_code for r in results] == [200, 200]
    assert [r.json()["usage"]["completion_tokens"] for r in results] == [200, 200]
    assert [r.json()["choices"][0]["text"] for r in results] == [alone, alone]
    assert health(bc.decode.address, "decode").num_preemptions > preempted_before
    wait_for_idle(bc.decode.address, "decode")


async def test_checksum_failure_frees_the_decode_workers_budget(bc, hf_model):
    rid = uuid.uuid4().hex
    async with grpc.aio.insecure_channel(bc.decode.address) as channel:
        call = open_decode_by_hand(channel, rid)
        accepted = await call.read()
        assert accepted.HasField("accepted")
        assert health(bc.decode.address, "decode").kv_used_tokens == 16  # the prompt and its first token: a block
        kv = fake_prompt_kv(rid, hf_model, prompt_len=9)
        kv.transfer_token = accepted.accepted.kv_transfer_token
        messages = list(encode_kv(kv, chunk_bytes=512))
        messages[2].block.data = b"\x01" + messages[2].block.data[1:]
        with pytest.raises(grpc.aio.AioRpcError, match="checksum mismatch"):
            await pb_grpc.KvReceiverStub(channel).PushKv(iter(messages), timeout=30)
        with pytest.raises(grpc.aio.AioRpcError):
            await call.read()
    wait_for_idle(bc.decode.address, "decode")


@contextlib.asynccontextmanager
async def prefill_into_stopped_decode_worker(bc, transport: str, prompt_len: int = 300):
    """A fresh decode worker with a request registered, then frozen (SIGSTOP), and a prefill streaming
    KV into it; yields (victim, prefill task) and kills the victim afterwards."""
    victim = start_worker("decode", bc.model_dir)
    rid = uuid.uuid4().hex
    channel = grpc.aio.insecure_channel(victim.address)
    pchannel = grpc.aio.insecure_channel(bc.prefill.address)
    decode_call = pb_grpc.DecodeServiceStub(channel).Decode(pb.DecodeRequest(
        request_id=rid, prompt_len=prompt_len, max_seq_len=2048,
        sampling=pb.SamplingParams(temperature=0, top_p=1, max_tokens=4)), timeout=60)
    try:
        accepted = await decode_call.read()
        kv_data_address = accepted.accepted.kv_data_address if transport == "tcp" else ""
        assert kv_data_address or transport == "grpc"
        victim.proc.send_signal(signal.SIGSTOP)
        prefill = asyncio.ensure_future(pb_grpc.PrefillServiceStub(pchannel).Prefill(pb.PrefillRequest(
            request_id=rid, prompt_token_ids=[7] * prompt_len, decode_address=victim.address,
            kv_data_address=kv_data_address, kv_transfer_token=accepted.accepted.kv_transfer_token,
            kv_layout_version=accepted.accepted.kv_layout_version, sampling=pb.SamplingParams(temperature=0, top_p=1, max_tokens=4)), timeout=60))
        deadline = time.monotonic() + 10
        while health(bc.prefill.address, "prefill").num_kv_leases == 0:
            assert time.monotonic() < deadline and not prefill.done()
            await asyncio.sleep(0.02)
        yield victim, prefill
    finally:
        victim.proc.kill()
        victim.proc.wait()
        decode_call.cancel()
        for ch in (channel, pchannel):
            await ch.close()


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
async def test_decode_worker_killed_during_transfer_frees_the_prefill_workers_kv(bc, transport):
    async with prefill_into_stopped_decode_worker(bc, transport) as (victim, prefill):
        # The prefill worker still holds the KV lease: its send into the frozen worker is under way.
        assert (await asyncio.to_thread(health, bc.prefill.address, "prefill")).num_kv_leases >= 1
        assert not prefill.done()
        victim.proc.send_signal(signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await prefill
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert victim.address in err.value.details()
        assert reason_from_metadata(err.value.trailing_metadata()) == pb.FAILURE_REASON_KV_SEND_FAILED
        wait_for_idle(bc.prefill.address, "prefill")


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
async def test_expired_kv_lease_frees_the_prefill_workers_kv(bc, transport):
    async with prefill_into_stopped_decode_worker(bc, transport) as (_, prefill):
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await prefill
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "KV lease" in err.value.details() and f"{LEASE_S}s" in err.value.details()
        assert reason_from_metadata(err.value.trailing_metadata()) == pb.FAILURE_REASON_KV_LEASE_EXPIRED
        assert time.monotonic() - started < LEASE_S + 5
        wait_for_idle(bc.prefill.address, "prefill")


def test_cluster_still_serves_after_the_faults(bc):
    resp = complete(bc.url, max_tokens=5, stream=False)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 5
    wait_for_idle(bc.prefill.address, "prefill")
    wait_for_idle(bc.decode.address, "decode")
