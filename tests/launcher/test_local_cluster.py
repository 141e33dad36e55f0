"""`pdserve up`: starts a cluster, serves, restarts what dies, and leaves no process behind after SIGTERM."""

from __future__ import annotations

import pytest

import json
import os
import signal
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import httpx

from tests.helpers import (REPO, BackgroundStream, ServerProcess, alive, cmdline, coordinator_pid, descendants,
                           free_port, management_url, pdserve_argv, registration_headers, scrape, sse_events,
                           wait_for, write_api_keys)

pytestmark = pytest.mark.system


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on, from its socket fds and /proc/net/tcp."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def assert_no_survivors(pids: set[int]) -> None:
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "child processes survived"


def test_up_serves_a_request_and_sigterm_leaves_no_process(model_dir):
    port = free_port()
    up = ServerProcess(pdserve_argv("up", "--predict-port", str(port), "--model", str(model_dir),
                                    "--worker-args=--block-size 32"), "pdserve ready:", timeout_s=180)
    try:
        assert up.address == f"http://127.0.0.1:{port}"
        kids = descendants(up.proc.pid)
        lines = [cmdline(p) for p in kids]
        assert sum("worker --role prefill" in c for c in lines) == 1
        assert sum("worker --role decode" in c for c in lines) == 1
        assert sum(" coordinator " in c for c in lines) == 1
        # The machine's cores are shared among the two workers; --worker-args reach every worker.
        threads = max(1, (os.cpu_count() or 1) // 2)
        workers = [c for c in lines if " worker --role " in c]
        assert all(f"--threads {threads} --block-size 32" in c for c in workers), workers

        resp = httpx.post(f"{up.address}/v1/chat/completions", timeout=60, json={
            "model": "pdserve-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    finally:
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=30) == 0
    deadline = time.monotonic() + 10
    while any(alive(p) for p in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in kids if alive(p)], "child processes survived SIGTERM"


def test_up_with_tls_makes_a_ca_and_serves_mutual_tls_with_api_keys(model_dir, tmp_path):
    tls_dir = tmp_path / "tls"
    keys = write_api_keys(tmp_path / "keys", ["up-test-key"])
    port = free_port()
    up = ServerProcess(pdserve_argv("up", "--predict-port", str(port), "--model", str(model_dir),
                                    "--tls", str(tls_dir), "--api-keys", str(keys)), "pdserve ready:", timeout_s=180)
    try:
        assert up.address == f"https://127.0.0.1:{port}"
        assert sorted(p.name for p in tls_dir.glob("*.pem")) == [
            "ca-key.pem", "ca.pem", "client-key.pem", "client.pem", "server-key.pem", "server.pem"]
        assert (tls_dir / "client-key.pem").stat().st_mode & 0o077 == 0
        ctx = ssl.create_default_context(cafile=str(tls_dir / "ca.pem"))
        ctx.load_cert_chain(str(tls_dir / "client.pem"), str(tls_dir / "client-key.pem"))
        body = {"model": "pdserve-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        with httpx.Client(verify=ctx, timeout=60) as client:
            assert client.post(f"{up.address}/v1/chat/completions", json=body).status_code == 401
            resp = client.post(f"{up.address}/v1/chat/completions", json=body,
                               headers={"Authorization": "Bearer up-test-key"})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
        no_cert = ssl.create_default_context(cafile=str(tls_dir / "ca.pem"))
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            httpx.post(f"{up.address}/v1/chat/completions", json=body, verify=no_cert, timeout=10,
                       headers={"Authorization": "Bearer up-test-key"})
    finally:
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=30) == 0


MAX_TOKENS = 800  # long enough to still stream when the kill lands, even on an idle machine


def test_up_restarts_a_killed_decode_worker_on_its_address_while_its_streams_migrate(model_dir, tmp_path):
    config = tmp_path / "ms_coordinator.json"
    config.write_text(json.dumps({"http_config": {"manage_port": 0}, "model_config": {
        "maxIterTimes": MAX_TOKENS, "maxSeqLen": 2048, "maxInputTokenLen": 2048}}))
    up = ServerProcess(pdserve_argv("up", "--config", str(config), "--predict-port", str(free_port()),
                                    "--prefill", "2", "--decode", "2", "--model", str(model_dir)),
                       "pdserve ready:", timeout_s=180)
    kids = descendants(up.proc.pid)
    try:
        manage, headers = management_url(up), registration_headers(up)

        def instances() -> dict:
            return {role: {i["address"]: i for i in group} for role, group in
                    httpx.get(f"{manage}/v1/instances", headers=headers, timeout=10).json().items()}

        assert len(instances()["decode"]) == 2
        body = {"model": "pdserve-tiny", "prompt": "Hello", "max_tokens": MAX_TOKENS, "stream": True,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}
        readers = [BackgroundStream(f"{up.address}/v1/completions", body) for _ in range(4)]
        assert all(r.first_chunk.wait(60) for r in readers)
        victim = next(a for a, i in instances()["decode"].items() if i["outstanding_requests"])
        port = int(victim.rsplit(":", 1)[1])
        victim_pid = next(p for p in kids if "worker --role decode" in cmdline(p) and port in listening_ports(p))
        os.kill(victim_pid, signal.SIGKILL)

        # Restarted on the same gRPC port: healthy again in the coordinator's unchanged instance list.
        wait_for(lambda: f"is back at {victim}" in "".join(up.output), 60, f"{victim} restarted")
        restarted = [p for p in descendants(up.proc.pid) if "worker --role decode" in cmdline(p) and p not in kids]
        assert len(restarted) == 1 and f"--port {port} " in cmdline(restarted[0])
        assert port in listening_ports(restarted[0])
        log = "".join(up.output)
        assert f"(pid {victim_pid}, {victim}) killed by SIGKILL; restart 1 in 0.5s" in log
        assert f"is back at {victim} (pid {restarted[0]}, restarts 1)" in log
        wait_for(lambda: instances()["decode"][victim]["state"] == "healthy", 30, f"{victim} healthy again")

        for reader in readers:  # meanwhile every stream moved to the other decode worker, and ends complete
            reader.join(60)
            payloads = sse_events(reader.raw)
            assert payloads[-1] == "[DONE]"
            chunks = [json.loads(p) for p in payloads[:-1]]
            assert not any("error" in c for c in chunks), chunks[-3:]
            assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
            assert sum(len(c["choices"][0].get("token_ids") or []) for c in chunks if c["choices"]) == MAX_TOKENS
        assert scrape(up.address)[("pdserve_request_migrations_total", ())] >= 1

        served = instances()["decode"][victim]["served"]
        for _ in range(4):  # round robin: the restarted worker takes its share
            resp = httpx.post(f"{up.address}/v1/completions", timeout=60, json={
                "model": "pdserve-tiny", "prompt": "Hi", "max_tokens": 3})
            assert resp.status_code == 200, resp.text
        assert instances()["decode"][victim]["served"] > served
        kids |= descendants(up.proc.pid)
    finally:
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=30) == 0
    assert_no_survivors(kids)


def test_up_exits_1_naming_a_process_that_keeps_failing_to_start(model_dir):
    port = free_port()
    up = ServerProcess(pdserve_argv("up", "--predict-port", str(port), "--model", str(model_dir),
                                    "--restart-backoff", "0.1", "--max-start-failures", "2"),
                       "pdserve ready:", timeout_s=180)
    kids = descendants(up.proc.pid)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        os.kill(coordinator_pid(up), signal.SIGKILL)

        def bound() -> bool:  # the port is free once the kill has landed; every restart then finds it taken
            try:
                squatter.bind(("127.0.0.1", port))
            except OSError:
                return False
            return True

        wait_for(bound, 5, f"port {port} free")
        squatter.listen()
        try:
            assert up.proc.wait(timeout=60) == 1
        finally:
            up.stop()
    log = wait_for(lambda: "".join(up.output) if "in a row" in "".join(up.output) else "", 5, "the final message")
    message = log[log.index("pdserve: coordinator failed to start"):]
    assert message.startswith("pdserve: coordinator failed to start 2 times in a row (last: exited with code 1 "
                              "before it was ready); its last output:")
    assert "address already in use" in message
    assert "restart 2 in 0.2s" in log  # backoff doubles
    assert_no_survivors(kids)


@pytest.mark.long
def test_up_autoscale_adds_the_decode_worker_the_planner_asks_for_and_fails_no_request(model_dir, tmp_path):
    # Decode steps of 5 ms + 10 ms per sequence (at most 100 tokens/s a worker): one decode worker cannot keep up
    # with 3 requests a second of 48 tokens each; two can, within a TPOT of 100 ms.
    config = tmp_path / "ms_coordinator.json"
    config.write_text(json.dumps({
        "planner_config": {"ttft_ms": 5000, "tpot_ms": 100, "interval_s": 1, "window_s": 10, "min_requests": 5,
                           "confirmations": 1, "cooldown_s": 0},
        "model_config": {"maxIterTimes": 64}}))
    up = ServerProcess(pdserve_argv("up", "--config", str(config), "--predict-port", str(free_port()),
                                    "--model", str(model_dir), "--autoscale", "--max-workers", "3",
                                    "--worker-args=--simulate --sim-decode-ms-per-seq 10"),
                       "pdserve ready:", timeout_s=180)
    management = next(line.split()[-1] for line in up.output if line.startswith("pdserve coordinator management:"))
    headers = registration_headers(up)

    def decode_count() -> int:
        return len(httpx.get(f"{management}/v1/instances", headers=headers, timeout=10).json()["decode"])

    statuses: list[int] = []

    def one(i: int) -> None:
        time.sleep(i / 3)
        resp = httpx.post(f"{up.address}/v1/completions", timeout=120, json={
            "model": "pdserve-tiny", "prompt": f"request {i}", "max_tokens": 48, "ignore_eos": True})
        statuses.append(resp.status_code)

    try:
        assert decode_count() == 1
        threads = [threading.Thread(target=one, args=(i,)) for i in range(100)]
        for thread in threads:
            thread.start()
        wait_for(lambda: decode_count() == 2, timeout_s=90, what="a second decode worker started and registered")
        plan = httpx.get(f"{management}/v1/plan", headers=headers, timeout=10).json()
        assert plan["desired"]["decode"] == 2 and plan["history"][-1]["reason"] in ("meets_slo", "best_effort")
        assert httpx.get(f"{management}/v1/plan", timeout=10).status_code == 401  # registration proof
        for thread in threads:
            thread.join(180)
        assert statuses and set(statuses) == {200}, statuses
    finally:
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=60) == 0


@pytest.mark.parametrize("flags,message", [
    (["--max-workers", "4"], "--max-workers goes with --autoscale"),
    (["--autoscale", "--engine", "vllm"], "vLLM instances neither register"),
    (["--autoscale", "--prefill", "2", "--decode", "2", "--max-workers", "3"], "--max-workers >= their sum"),
])
def test_up_refuses_autoscale_flags_it_cannot_honour_naming_them(flags, message):
    done = subprocess.run(pdserve_argv("up", *flags), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
