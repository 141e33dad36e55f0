"""`pdserve worker --simulate`: the real protocol and KV streams with no model, behind a real coordinator."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
import uuid

import grpc
import httpx
import pytest

from kv_transfer.base import KvTransferError
from kv_transfer.tcp_transport import TcpKvSender
from kv_transfer.wire import header, item_messages, make_trailer
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from proto.failure_reason import reason_from_metadata
from tests.helpers import (REPO, ServerProcess, health, metrics_url, pdserve_argv, scrape, sse_events,
                          start_coordinator, wait_for_idle, wait_until, write_config)
from worker.simulated.kv import VerifyOnlyKvAssembler, synthetic_layer

pytestmark = pytest.mark.system

# A model shape unlike the defaults, so the KV sizes below can only come from these flags.
LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 3, 4, 16, 4
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * DTYPE_BYTES
DECODE_BASE_MS, DECODE_PER_SEQ_MS, PREFILL_BASE_MS, PREFILL_PER_TOKEN_MS = 5.0, 0.5, 2.0, 0.05
DECODE_BUDGET = 592  # 37 blocks of 16
MAX_ITER_TIMES = 300
SIM_FLAGS = ("--simulate", "--sim-layers", str(LAYERS), "--sim-kv-heads", str(KV_HEADS), "--sim-head-dim",
             str(HEAD_DIM), "--dtype", "float32", "--sim-decode-base-ms", str(DECODE_BASE_MS),
             "--sim-decode-ms-per-seq", str(DECODE_PER_SEQ_MS), "--sim-prefill-base-ms", str(PREFILL_BASE_MS),
             "--sim-prefill-ms-per-token", str(PREFILL_PER_TOKEN_MS))


def start_sim_worker(role: str, *extra: str, python_flags: tuple[str, ...] = ()) -> ServerProcess:
    python, *rest = pdserve_argv("worker", "--role", role, "--port", "0", *SIM_FLAGS, *extra)
    return ServerProcess([python, *python_flags, *rest], "pdserve worker ready:", timeout_s=30)


class SimCluster:
    def __init__(self, model_dir, tmp):
        self.prefill = start_sim_worker("prefill")
        self.decode = start_sim_worker("decode", "--kv-budget-tokens", str(DECODE_BUDGET))
        self.coordinator = start_coordinator(write_config(tmp / "ms_coordinator.json", [self.prefill.address],
                                                          [self.decode.address], model_dir,
                                                          maxIterTimes=MAX_ITER_TIMES))
        self.url = self.coordinator.address

    def stop(self) -> list[int]:
        return [proc.stop() for proc in (self.coordinator, self.prefill, self.decode)]


@pytest.fixture(scope="module")
def sim(model_dir, tmp_path_factory):
    cluster = SimCluster(model_dir, tmp_path_factory.mktemp("sim"))
    yield cluster
    assert cluster.stop() == [0, 0, 0]


def chat(url: str, **fields) -> httpx.Response:
    body = {"model": "pdserve-tiny", "messages": [{"role": "user", "content": "Count to ten."}], **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def synthetic_tokens(text: str) -> list[str]:
    tokens = text.split(" ")[1:]
    assert text == "".join(" " + t for t in tokens) and all(t.startswith("t") and t[1:].isdigit() for t in tokens)
    return tokens


@pytest.mark.parametrize("max_tokens", [1, 9, None])
def test_chat_answers_exactly_the_requested_tokens(sim, max_tokens):
    expected = max_tokens or MAX_ITER_TIMES + 1  # no max_tokens: maxIterTimes steps after the first token
    fields = {} if max_tokens is None else {"max_tokens": max_tokens}
    resp = chat(sim.url, **fields)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"]["completion_tokens"] == expected
    assert body["choices"][0]["finish_reason"] == "length"
    assert len(synthetic_tokens(body["choices"][0]["message"]["content"])) == expected
    assert len(body["decode_time_arr"]) == expected - 1


@pytest.mark.parametrize("max_tokens", [1, 9])
def test_streamed_chat_answers_exactly_the_requested_tokens(sim, max_tokens):
    resp = chat(sim.url, max_tokens=max_tokens, stream=True)
    assert resp.status_code == 200
    payloads = sse_events(resp.content)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert len(synthetic_tokens(text)) == max_tokens
    final = [c for c in chunks if c.get("usage")][-1]
    assert final["usage"]["completion_tokens"] == max_tokens
    assert final["choices"][0]["finish_reason"] == "length"


def test_tokens_follow_the_seed(sim):
    def content(seed):
        resp = chat(sim.url, max_tokens=6, seed=seed)
        assert resp.status_code == 200
        return resp.json()["choices"][0]["message"]["content"]

    assert content(11) == content(11) != content(12)


def test_kv_bytes_are_the_configured_models(sim):
    p_url, d_url = metrics_url(sim.prefill), metrics_url(sim.decode)
    p0, d0 = scrape(p_url), scrape(d_url)
    hits = health(sim.decode.address, "decode").prefix_hit_tokens
    resp = chat(sim.url, max_tokens=3)
    assert resp.status_code == 200
    prompt_tokens = resp.json()["usage"]["prompt_tokens"]
    held = health(sim.decode.address, "decode").prefix_hit_tokens - hits  # the decode worker's cache had these
    p1, d1 = scrape(p_url), scrape(d_url)
    sent = ("pdserve_kv_transfer_bytes_total", (("side", "send"), ("transport", "tcp")))
    received = ("pdserve_kv_transfer_bytes_total", (("side", "receive"), ("transport", "tcp")))
    assert p1[sent] - p0.get(sent, 0) == d1[received] - d0.get(received, 0) \
        == KV_BYTES_PER_TOKEN * (prompt_tokens - held)
    requests = ("pdserve_worker_requests_total", ())
    assert p1[requests] - p0[requests] == d1[requests] - d0[requests] == 1
    assert d1[("pdserve_worker_step_duration_seconds_count", (("kind", "decode"),))] \
        - d0.get(("pdserve_worker_step_duration_seconds_count", (("kind", "decode"),)), 0) == 2


def test_cancelled_stream_leaves_the_batch_and_frees_its_budget(sim):
    max_tokens = 300
    body = {"model": "pdserve-tiny", "messages": [{"role": "user", "content": "Go on."}], "max_tokens": max_tokens,
            "stream": True}
    decode_steps = ("pdserve_worker_step_duration_seconds_count", (("kind", "decode"),))
    steps_before = scrape(metrics_url(sim.decode)).get(decode_steps, 0)
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{sim.url}/v1/chat/completions", json=body) as resp:
            lines = resp.iter_lines()
            seen = 0
            while seen < 4:
                seen += next(lines).startswith("data: ")
            h = health(sim.decode.address, "decode")
            assert h.num_running == 1 and h.kv_capacity_tokens == DECODE_BUDGET
            assert 0 < h.kv_used_tokens < max_tokens  # admission holds the prompt's blocks, not max_tokens
    wait_for_idle(sim.decode.address, "decode", timeout_s=30)
    wait_for_idle(sim.prefill.address, "prefill", timeout_s=30)
    # It left the batch when the client left, not at its last token: the worker stepped it short of max_tokens.
    steps = scrape(metrics_url(sim.decode))[decode_steps] - steps_before
    assert steps < max_tokens - 1, steps


async def open_decode(stub, request_id: str, prompt_len: int, max_tokens: int, local_prefill: bool = False):
    call = stub.Decode(pb.DecodeRequest(
        request_id=request_id, prompt_len=prompt_len, sampling=pb.SamplingParams(max_tokens=max_tokens),
        max_seq_len=4096, prompt_token_ids=list(range(1, prompt_len + 1)) if local_prefill else [],
        local_prefill=local_prefill))
    return call


async def read_tokens(call) -> list[pb.TokenEvent]:
    tokens = []
    while (event := await call.read()) is not grpc.aio.EOF:
        if event.HasField("token"):
            tokens.append(event.token)
    return tokens


async def test_decode_batch_steps_every_sequence_together_with_local_prefill(sim):
    n, prompt_len, max_tokens = 8, 20, 15
    async with grpc.aio.insecure_channel(sim.decode.address) as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        calls = [await open_decode(stub, f"batch-{i}-{uuid.uuid4().hex}", prompt_len, max_tokens, local_prefill=True)
                 for i in range(n)]
        results = await asyncio.gather(*(read_tokens(call) for call in calls))
    for tokens in results:
        assert [t.index for t in tokens] == list(range(max_tokens))
        assert [t.finish_reason for t in tokens] == [pb.FINISH_REASON_UNSPECIFIED] * (max_tokens - 1) + \
            [pb.FINISH_REASON_LENGTH]
        assert tokens[0].time_ms >= PREFILL_BASE_MS + PREFILL_PER_TOKEN_MS * prompt_len  # prefilled here
    full = [t for tokens in results for t in tokens[1:] if t.batch_size == n]
    assert full, "the sequences never ran as one batch"
    # A step's time grows with the batch: one of 8 can never be faster than the cost model's step (less the
    # event loop's timer granularity: uvloop's clock ticks in whole milliseconds, cached per loop turn).
    assert min(t.time_ms for t in full) >= DECODE_BASE_MS + DECODE_PER_SEQ_MS * n - 1.5
    wait_for_idle(sim.decode.address, "decode")


async def test_kv_budget_admits_first_come_first_served_and_refuses_what_never_fits(sim):
    async with grpc.aio.insecure_channel(sim.decode.address) as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        big = await open_decode(stub, f"big-{uuid.uuid4().hex}", 300, 20)  # holds 19 blocks (304) of 592 tokens
        assert (await big.read()).HasField("accepted")
        small = await open_decode(stub, f"small-{uuid.uuid4().hex}", 300, 20)  # needs 304 more: waits
        waiting = asyncio.ensure_future(small.read())

        async def small_arrived():  # in line or (wrongly) admitted, small waits as big does
            h = await asyncio.to_thread(health, sim.decode.address, "decode")
            return h if h.num_waiting == 2 else None

        h = await wait_until(small_arrived, what="the small request to reach the worker")
        assert not waiting.done()
        assert h.kv_used_tokens == 304 and h.num_waiting == 2  # small in line, big waiting for its KV
        big.cancel()
        assert (await asyncio.wait_for(waiting, 5)).HasField("accepted")
        small.cancel()
        never = await open_decode(stub, f"never-{uuid.uuid4().hex}", 20, DECODE_BUDGET)  # 20 + 592 > 592
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await never.read()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and str(DECODE_BUDGET) in err.value.details()
    wait_for_idle(sim.decode.address, "decode")


async def test_prefill_pushes_over_grpc_when_no_tcp_receiver_is_named(sim):
    rid, prompt_len = f"push-{uuid.uuid4().hex}", 33
    async with grpc.aio.insecure_channel(sim.decode.address) as dch, \
            grpc.aio.insecure_channel(sim.prefill.address) as pch:
        decode = await open_decode(pb_grpc.DecodeServiceStub(dch), rid, prompt_len, 4)
        accepted = await decode.read()
        assert accepted.accepted.kv_data_address  # a TCP receiver is announced; this test skips it on purpose
        resp = await pb_grpc.PrefillServiceStub(pch).Prefill(pb.PrefillRequest(
            request_id=rid, prompt_token_ids=list(range(prompt_len)), sampling=pb.SamplingParams(max_tokens=4),
            decode_address=sim.decode.address, kv_data_address="",
            kv_transfer_token=accepted.accepted.kv_transfer_token,
            kv_layout_version=accepted.accepted.kv_layout_version))
        tokens = await read_tokens(decode)
    assert resp.kv_bytes == KV_BYTES_PER_TOKEN * prompt_len
    assert tokens[0].token_id == resp.first_token_id and [t.index for t in tokens] == [0, 1, 2, 3]


async def test_kv_stream_of_the_wrong_size_is_refused(sim):
    rid = f"bad-{uuid.uuid4().hex}"
    async with grpc.aio.insecure_channel(sim.decode.address) as channel:
        decode = await open_decode(pb_grpc.DecodeServiceStub(channel), rid, 10, 4)
        accepted = await decode.read()

        async def items():  # 9 positions for a 10-token prompt
            yield header(rid, "float32", LAYERS, (9, KV_HEADS, HEAD_DIM), accepted.accepted.kv_transfer_token)
            for i in range(LAYERS):
                yield synthetic_layer(i, KV_HEADS * 9 * HEAD_DIM * DTYPE_BYTES)
            yield make_trailer(5, 1.0)

        with pytest.raises(KvTransferError, match="holds positions up to 9 but the prompt has 10 tokens"):
            await TcpKvSender().send_items(accepted.accepted.kv_data_address, items())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await decode.read()
        assert err.value.code() == grpc.StatusCode.DATA_LOSS
    wait_for_idle(sim.decode.address, "decode")


async def test_a_prefill_for_a_decode_worker_of_another_kv_layout_is_refused_naming_both_versions(sim):
    async with grpc.aio.insecure_channel(sim.prefill.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.PrefillServiceStub(channel).Prefill(pb.PrefillRequest(
                request_id=f"old-{uuid.uuid4().hex}", prompt_token_ids=[1, 2, 3],
                sampling=pb.SamplingParams(max_tokens=2), decode_address=sim.decode.address, kv_layout_version=1),
                timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == ("KV layout version 1 (head-major) from the decode worker; this worker writes "
                                   "version 2 (token-major per block)")
    # The coordinator reads it as a hand-over that failed: retried elsewhere, the decode worker blamed.
    assert reason_from_metadata(err.value.trailing_metadata()) == pb.FAILURE_REASON_KV_SEND_FAILED
    wait_for_idle(sim.prefill.address, "prefill")


async def test_a_kv_stream_from_a_prefill_worker_before_layout_versions_is_refused_naming_it(sim):
    rid = f"old-{uuid.uuid4().hex}"
    refusal = ("KV layout version 0 (not set: a worker from before layout versions, head-major) from the prefill "
               "worker; this worker reads version 2 (token-major per block)")
    async with grpc.aio.insecure_channel(sim.decode.address) as channel:
        decode = await open_decode(pb_grpc.DecodeServiceStub(channel), rid, 10, 4)
        accepted = await decode.read()
        assert accepted.accepted.kv_layout_version == 2

        async def items():  # as such a worker sent it: no version, head-major
            old = header(rid, "float32", LAYERS, (10, KV_HEADS, HEAD_DIM), accepted.accepted.kv_transfer_token)
            old.ClearField("kv_layout_version")
            old.shape[:] = [1, KV_HEADS, 10, HEAD_DIM]
            yield old
            for i in range(LAYERS):
                yield synthetic_layer(i, KV_HEADS * 10 * HEAD_DIM * DTYPE_BYTES)
            yield make_trailer(5, 1.0)

        with pytest.raises(KvTransferError, match=re.escape(refusal)):
            await TcpKvSender().send_items(accepted.accepted.kv_data_address, items())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await decode.read()
        assert err.value.code() == grpc.StatusCode.DATA_LOSS and refusal in err.value.details()
    wait_for_idle(sim.decode.address, "decode")


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system) a process has used so far, as the kernel counts it: unlike the time it took,
    it does not grow with what else the machine runs."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def test_simulated_worker_is_light_and_stops_cleanly():
    worker = start_sim_worker("decode", python_flags=("-X", "importtime"))
    ready_cpu_s = cpu_seconds(worker.proc.pid)
    rss_kb = int(next(l for l in open(f"/proc/{worker.proc.pid}/status") if l.startswith("VmRSS:")).split()[1])
    assert worker.stop() == 0
    imported = {line.split("|")[-1].strip() for line in worker.output if line.startswith("import time:")}
    assert "grpc" in imported  # the import log is really there
    assert not {m for m in imported if m.split(".")[0] in ("torch", "transformers", "numpy")}
    assert ready_cpu_s < 3.0 and rss_kb < 120_000, (ready_cpu_s, rss_kb)


def test_workers_register_with_the_coordinator(model_dir, tmp_path):
    config = write_config(tmp_path / "ms_coordinator.json", [], [], model_dir)
    coordinator = start_coordinator(config)
    manage = next(l for l in coordinator.output if l.startswith("pdserve coordinator management:")).split()[-1]
    workers = [start_sim_worker(role, "--coordinator", manage, "--heartbeat-interval", "0.5")
               for role in ("prefill", "decode")]
    try:
        deadline = time.monotonic() + 10
        while (resp := chat(coordinator.address, max_tokens=4)).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 4
    finally:
        assert [w.stop() for w in workers] == [0, 0]
        coordinator.stop()


def test_bad_cost_model_flag_is_refused_clearly():
    out = subprocess.run(pdserve_argv("worker", "--role", "decode", "--simulate", "--sim-decode-base-ms", "-1"),
                         cwd=REPO, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "decode_base_ms=-1.0 must be a finite number >= 0" in out.stderr


@pytest.mark.parametrize("flip", [False, True])
def test_simulated_receiver_verifies_every_block(flip):
    items = [header("r", "float16", 2, (5, 2, 8)), *(synthetic_layer(i, 2 * 5 * 8 * 2) for i in range(2)),
             make_trailer(3, 0.5)]
    messages = [m for item in items for m in item_messages(item, chunk_bytes=48)]
    if flip:
        block = messages[4].block
        block.data = bytes([block.data[0] ^ 1]) + block.data[1:]
    assembler = VerifyOnlyKvAssembler(messages[0].header)
    if flip:
        with pytest.raises(KvTransferError, match="layer 0 key offset 144: checksum mismatch"):
            for m in messages[1:]:
                assembler.add_message(m)
        return
    for m in messages[1:]:
        assembler.add_message(m)
    kv = assembler.finish()
    assert (kv.seq_len, kv.num_bytes, kv.first_token_id) == (5, 2 * 2 * 160, 3)
