"""A worker that goes silent without closing its connections (SIGSTOP; its network link cut) is declared
lost within 5 s: its streams migrate as after a SIGKILL, and it is back in rotation once it answers."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time

import httpx
import pytest

from tests.helpers import (BackgroundStream, ServerProcess, management_url, pdserve_argv, reference_tokens, scrape,
                           sse_events, start_coordinator, start_worker, wait_for, write_config)

pytestmark = pytest.mark.system

MAX_TOKENS = 600  # still streaming when the worker goes silent, even on an idle machine
LONG = {"maxIterTimes": MAX_TOKENS, "maxSeqLen": 2048, "maxInputTokenLen": 2048}
DETECTION_S = 5.0
PROMPTS = ["Hello", "The quick brown fox", "Once upon a time", "In the beginning"]


def stream_body(prompt: str) -> dict:
    return {"model": "pdserve-tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream_options": {"include_usage": True}}


def instances(coordinator) -> dict[str, dict[str, dict]]:
    body = httpx.get(f"{management_url(coordinator)}/v1/instances", timeout=10).json()
    return {role: {i["address"]: i for i in group} for role, group in body.items()}


def busy_decode(coordinator, among: set[str]) -> str:
    """A decode instance among `among` with a request running on it."""
    return wait_for(lambda: next((a for a, i in instances(coordinator)["decode"].items()
                                  if a in among and i["outstanding_requests"]), None), 10, "a busy decode instance")


def assert_streams_complete_and_exact(readers, hf_model) -> None:
    """Every stream ran to its last token with no error; the first is the uninterrupted greedy sequence."""
    for n, (prompt, reader) in enumerate(readers):
        reader.join(120)
        payloads = sse_events(reader.raw)
        assert payloads[-1] == "[DONE]"
        chunks = [json.loads(p) for p in payloads[:-1]]
        assert not any("error" in c for c in chunks), chunks[-3:]
        assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
        streamed = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids", [])]
        assert len(streamed) == MAX_TOKENS
        if n == 0:  # greedy decoding resumed from prompt + sent tokens gives exactly the uninterrupted sequence
            assert streamed == reference_tokens(hf_model, hf_model[1](prompt)["input_ids"], MAX_TOKENS)


def assert_declared_lost(coordinator, role: str, address: str) -> None:
    """The coordinator took the instance out as lost (its later failed health checks may reword the reason)."""
    assert instances(coordinator)[role][address]["state"] == "unhealthy"
    assert any(f"{role} instance {address} worker lost" in line for line in coordinator.output)


def test_a_frozen_decode_worker_is_declared_lost_and_its_streams_migrate(cluster, tmp_path, hf_model):
    decodes = {w.address: w for w in (start_worker("decode", cluster.model_dir),
                                      start_worker("decode", cluster.model_dir))}
    coordinator = start_coordinator(write_config(tmp_path / "ms_coordinator.json", [cluster.prefill.address],
                                                 list(decodes), cluster.model_dir, **LONG))
    victim = None
    try:
        readers = [(p, BackgroundStream(f"{coordinator.address}/v1/completions", stream_body(p))) for p in PROMPTS]
        assert all(r.first_chunk.wait(30) for _, r in readers)
        victim = busy_decode(coordinator, set(decodes))
        frozen_at = time.monotonic()
        decodes[victim].proc.send_signal(signal.SIGSTOP)
        assert_streams_complete_and_exact(readers, hf_model)
        # No stream waited longer than the detection bound for its next token.
        assert max(r.longest_gap(frozen_at) for _, r in readers) < DETECTION_S
        assert_declared_lost(coordinator, "decode", victim)
        assert scrape(coordinator.address)[("pdserve_request_migrations_total", ())] >= 1
        # Thawed, it answers health checks again and is back in rotation.
        decodes[victim].proc.send_signal(signal.SIGCONT)
        wait_for(lambda: instances(coordinator)["decode"][victim]["state"] == "healthy", 20, "the thawed worker back")
    finally:
        if victim is not None:
            decodes[victim].proc.send_signal(signal.SIGCONT)
        coordinator.stop()
        for worker in decodes.values():
            worker.stop()


def test_a_frozen_prefill_worker_is_declared_lost_and_its_requests_go_to_another(cluster, tmp_path):
    frozen = start_worker("prefill", cluster.model_dir)
    # The decode worker's own KV receive timeout (10 s) would retry the request too, later: only the watch is in time.
    decode = start_worker("decode", cluster.model_dir, "--kv-trans-timeout", "10")
    coordinator = start_coordinator(write_config(
        tmp_path / "ms_coordinator.json", [frozen.address, cluster.prefill.address], [decode.address],
        cluster.model_dir))
    try:
        frozen.proc.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        with httpx.Client(timeout=60) as client:
            # Round robin sends one of the first two to the frozen worker.
            replies = [client.post(f"{coordinator.address}/v1/completions", json={
                "model": "pdserve-tiny", "prompt": f"Hello {i}", "max_tokens": 4}) for i in range(2)]
        assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
        assert time.monotonic() - started < DETECTION_S + 3
        assert_declared_lost(coordinator, "prefill", frozen.address)
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
        coordinator.stop()
        frozen.stop()
        decode.stop()


_subnets = itertools.count(1)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture
def namespace():
    """A network namespace joined to this one by a veth pair: (namespace, host-side link, address inside)."""
    tag = f"{os.getpid() % 10000}x{next(_subnets)}"
    name, outside, inside = f"pds{tag}", f"pdh{tag}", f"pdn{tag}"
    subnet = f"10.{200 + os.getpid() % 50}.{next(_subnets) % 250}"
    if _ip("netns", "add", name, check=False).returncode != 0:
        pytest.skip("creating a network namespace needs root (CAP_NET_ADMIN)")
    try:
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", name)
        _ip("addr", "add", f"{subnet}.1/30", "dev", outside)
        _ip("link", "set", outside, "up")
        for args in (("addr", "add", f"{subnet}.2/30", "dev", inside), ("link", "set", inside, "up"),
                     ("link", "set", "lo", "up")):
            _ip("-n", name, *args)
        yield name, outside, f"{subnet}.2"
    finally:
        _ip("link", "del", outside, check=False)
        _ip("netns", "del", name, check=False)


def test_a_decode_worker_whose_link_is_cut_is_declared_lost_and_its_streams_migrate(cluster, tmp_path, hf_model,
                                                                                   namespace):
    name, link, address = namespace
    remote = ServerProcess(["ip", "netns", "exec", name, *pdserve_argv(
        "worker", "--role", "decode", "--model", str(cluster.model_dir), "--host", address, "--port", "0")],
        "pdserve worker ready:")
    local = start_worker("decode", cluster.model_dir)
    coordinator = start_coordinator(write_config(tmp_path / "ms_coordinator.json", [cluster.prefill.address],
                                                 [remote.address, local.address], cluster.model_dir, **LONG))
    try:
        readers = [(p, BackgroundStream(f"{coordinator.address}/v1/completions", stream_body(p))) for p in PROMPTS]
        assert all(r.first_chunk.wait(30) for _, r in readers)
        busy_decode(coordinator, {remote.address})
        cut_at = time.monotonic()
        _ip("link", "set", link, "down")  # a black hole: no resets, the connections just stall
        assert_streams_complete_and_exact(readers, hf_model)
        assert max(r.longest_gap(cut_at) for _, r in readers) < DETECTION_S
        assert_declared_lost(coordinator, "decode", remote.address)
        _ip("link", "set", link, "up")
        wait_for(lambda: instances(coordinator)["decode"][remote.address]["state"] == "healthy", 30,
                 "the reconnected worker back")
    finally:
        coordinator.stop()
        remote.proc.kill()
        remote.proc.wait()
        local.stop()
