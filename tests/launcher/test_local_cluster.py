"""`pdserve up`: starts a cluster, serves, and leaves no process behind after SIGTERM."""

from __future__ import annotations

import pytest

import signal
import socket
import ssl
import time
from pathlib import Path

import httpx

from tests.helpers import ServerProcess, pdserve_argv, write_api_keys

pytestmark = pytest.mark.system


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_up_serves_a_request_and_sigterm_leaves_no_process(model_dir):
    port = free_port()
    up = ServerProcess(pdserve_argv("up", "--predict-port", str(port), "--model", str(model_dir)),
                       "pdserve ready:", timeout_s=180)
    try:
        assert up.address == f"http://127.0.0.1:{port}"
        kids = descendants(up.proc.pid)
        lines = [cmdline(p) for p in kids]
        assert sum("worker --role prefill" in c for c in lines) == 1
        assert sum("worker --role decode" in c for c in lines) == 1
        assert sum(" coordinator " in c for c in lines) == 1

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
