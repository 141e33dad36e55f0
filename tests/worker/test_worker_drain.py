"""SIGTERM to a worker: it refuses new requests, lets running ones finish, then exits 0."""

from __future__ import annotations

import json
import signal
import time

import grpc
import httpx
import pytest

from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from proto.failure_reason import reason_from_metadata
from tests.helpers import (BackgroundStream, health, management_url, scrape, sse_events, start_coordinator,
                           start_worker, wait_for, write_config)

pytestmark = pytest.mark.system

LONG_TOKENS = 1500  # over a second of decoding even on an idle machine: still streaming when the signal lands


def long_stream_cluster(cluster, decode, tmp_path):
    config = write_config(tmp_path / "ms_coordinator.json", [cluster.prefill.address], [decode.address],
                          cluster.model_dir, maxIterTimes=2000, maxSeqLen=2048, maxInputTokenLen=2048)
    coordinator = start_coordinator(config)
    body = {"model": "pdserve-tiny", "prompt": "Hello", "max_tokens": LONG_TOKENS, "stream": True,
            "temperature": 0, "ignore_eos": True}
    reader = BackgroundStream(f"{coordinator.address}/v1/completions", body)
    assert reader.first_chunk.wait(30)
    return coordinator, reader


def wait_until_draining(address: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not health(address, "decode").draining:
        assert time.monotonic() < deadline, "the worker never reported draining"
        time.sleep(0.02)


def test_sigterm_mid_stream_finishes_the_stream_refuses_new_requests_and_exits_zero(cluster, tmp_path):
    decode = start_worker("decode", cluster.model_dir, "--drain-seconds", "60")
    coordinator, reader = long_stream_cluster(cluster, decode, tmp_path)
    try:
        decode.proc.send_signal(signal.SIGTERM)
        wait_until_draining(decode.address)
        assert reader.ended_at is None, "the stream ended before the worker drained it"
        with grpc.insecure_channel(decode.address) as channel:
            call = pb_grpc.DecodeServiceStub(channel).Decode(pb.DecodeRequest(
                request_id="after-sigterm", prompt_len=3, max_seq_len=64, prompt_token_ids=[5, 6, 7],
                local_prefill=True, sampling=pb.SamplingParams(temperature=0, top_p=1, max_tokens=2)), timeout=10)
            with pytest.raises(grpc.RpcError) as err:
                next(call)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
        assert reason_from_metadata(err.value.trailing_metadata()) == pb.FAILURE_REASON_DRAINING
        reader.join(120)
        payloads = sse_events(reader.raw)
        assert payloads[-1] == "[DONE]"
        final = json.loads(payloads[-2])
        assert final["choices"][0]["finish_reason"] == "length"
        assert final["usage"]["completion_tokens"] == LONG_TOKENS
        assert decode.proc.wait(timeout=30) == 0
    finally:
        coordinator.stop()
        decode.stop()


def test_requests_still_running_after_drain_seconds_are_cut_and_the_worker_exits_zero(cluster, tmp_path):
    decode = start_worker("decode", cluster.model_dir, "--drain-seconds", "0.05")
    coordinator, reader = long_stream_cluster(cluster, decode, tmp_path)
    try:
        decode.proc.send_signal(signal.SIGTERM)
        assert decode.proc.wait(timeout=30) == 0
        # It stopped when drain_seconds ran out, as it says, not when its request ended.
        wait_for(lambda: "still in flight after draining; stopping anyway" in "".join(decode.output), 30,
                 "the worker's word that the drain timed out")
        reader.join(30)
        payloads = sse_events(reader.raw)
        assert payloads[-1] == "[DONE]" and "error" in json.loads(payloads[-2])
        assert len(payloads) - 2 < LONG_TOKENS  # it really was cut short
    finally:
        coordinator.stop()
        decode.stop()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_sigterm_on_an_idle_worker_exits_zero_promptly(model_dir, role):
    worker = start_worker(role, model_dir, "--drain-seconds", "600")
    try:
        worker.proc.send_signal(signal.SIGTERM)
        # Nothing to drain: it exits at once, far within the drain_seconds it would otherwise wait.
        assert worker.proc.wait(timeout=60) == 0
    finally:
        worker.proc.kill()


def test_streams_still_running_when_the_drain_budget_ends_move_to_another_decode_worker_with_their_text_unchanged(
        cluster, tmp_path):
    """A drain budget too short for the streams: the worker ends them as draining, the coordinator migrates them
    (prompt + tokens sent) and the client's text is the one an undisturbed run gives."""
    leaving = start_worker("decode", cluster.model_dir, "--drain-seconds", "0.2")
    staying = start_worker("decode", cluster.model_dir)
    config = write_config(tmp_path / "ms_coordinator.json", [cluster.prefill.address],
                          [leaving.address, staying.address], cluster.model_dir, maxIterTimes=2000, maxSeqLen=2048,
                          maxInputTokenLen=2048)
    coordinator = start_coordinator(config)
    body = {"model": "pdserve-tiny", "prompt": "Hello", "max_tokens": LONG_TOKENS, "temperature": 0,
            "ignore_eos": True}
    try:
        # Streams on both decode workers: those on the other one run undisturbed and give the text to compare with.
        readers = [BackgroundStream(f"{coordinator.address}/v1/completions", {**body, "stream": True})
                   for _ in range(4)]
        for reader in readers:
            assert reader.first_chunk.wait(30)
        on_it = {i["address"]: i["outstanding_requests"] for i in httpx.get(
            f"{management_url(coordinator)}/v1/instances", timeout=10).json()["decode"]}[leaving.address]
        assert on_it >= 1
        leaving.proc.send_signal(signal.SIGTERM)
        assert leaving.proc.wait(timeout=60) == 0  # it stopped by itself once its budget ran out
        texts = []
        for reader in readers:
            reader.join(120)
            payloads = sse_events(reader.raw)
            assert payloads[-1] == "[DONE]", (payloads[-3:], "".join(coordinator.output[-20:]))
            chunks = [json.loads(p) for p in payloads[:-1]]
            texts.append("".join(c["choices"][0]["text"] for c in chunks if c.get("choices")))
        assert len(set(texts)) == 1 and len(texts[0]) > 0
        migrations = scrape(management_url(coordinator))[("pdserve_request_migrations_total", ())]
        assert migrations == on_it, "".join(coordinator.output[-20:])
    finally:
        coordinator.stop()
        leaving.stop()
        staying.stop()
