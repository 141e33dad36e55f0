"""Shared fixtures: the embedded model, and a real cluster of processes on free 127.0.0.1 ports."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
CLUSTER_MAX_ITER_TIMES = 12
CLUSTER_MAX_SEQ_LEN = 512
CLUSTER_KV_TIMEOUT_S = 3.0


def pdserve_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher.cli", *args]


class ServerProcess:
    """A pdserve process started for a test: waits for its ready line, cleans up after itself."""

    def __init__(self, argv: list[str], ready_prefix: str, timeout_s: float = 120.0, env: dict | None = None):
        self.argv = argv
        self.proc = subprocess.Popen(
            argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **(env or {})},
        )
        self.output: list[str] = []
        lines: queue.Queue = queue.Queue()

        def pump():
            for line in self.proc.stdout:
                self.output.append(line)
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise TimeoutError(f"{argv} not ready after {timeout_s}s:\n{''.join(self.output)}")
            if line is None:
                raise RuntimeError(f"{argv} exited with {self.proc.wait()}:\n{''.join(self.output)}")
            if line.startswith(ready_prefix):
                self.address = line.strip().rsplit(" ", 1)[-1].split("=", 1)[-1]
                return

    def stop(self, timeout_s: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_worker(role: str, model_dir: Path, *extra: str) -> ServerProcess:
    argv = pdserve_argv("worker", "--role", role, "--model", str(model_dir), "--port", "0", *extra)
    return ServerProcess(argv, "pdserve worker ready:")


def write_config(path: Path, prefill: list[str], decode: list[str], model_dir: Path, sections: dict | None = None,
                 **model_overrides) -> Path:
    """An ms_coordinator.json for a test cluster; `sections` adds or replaces top-level sections."""
    config = {
        "http_config": {"predict_ip": "127.0.0.1", "predict_port": 0, "manage_port": 0},
        "model_config": {"modelName": "pdserve-tiny", "modelWeightPath": str(model_dir),
                         "maxSeqLen": CLUSTER_MAX_SEQ_LEN, "maxInputTokenLen": CLUSTER_MAX_SEQ_LEN,
                         "maxIterTimes": CLUSTER_MAX_ITER_TIMES, **model_overrides},
        "instances": {"prefill": [{"address": a} for a in prefill], "decode": [{"address": a} for a in decode]},
        **(sections or {}),
    }
    path.write_text(json.dumps(config))
    return path


def start_coordinator(config_path: Path) -> ServerProcess:
    return ServerProcess(pdserve_argv("coordinator", "--config", str(config_path)), "pdserve coordinator ready:")


def management_url(coordinator: ServerProcess) -> str:
    """The management URL a coordinator printed before its ready line."""
    line = next(l for l in coordinator.output if l.startswith("pdserve coordinator management:"))
    return line.strip().rsplit(" ", 1)[-1]


def instance_states(coordinator: ServerProcess) -> dict[str, dict[str, str]]:
    """role -> address -> state, from the coordinator's management API."""
    body = httpx.get(f"{management_url(coordinator)}/v1/instances", timeout=10).json()
    return {role: {i["address"]: i["state"] for i in group} for role, group in body.items()}


@dataclass
class Cluster:
    """A running coordinator with one prefill and one decode worker."""

    url: str
    prefill: ServerProcess
    decode: ServerProcess
    coordinator: ServerProcess
    model_dir: Path

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from embedded_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def cluster(model_dir: Path, tmp_path_factory) -> Cluster:
    prefill = start_worker("prefill", model_dir)
    decode = start_worker("decode", model_dir, "--kv-trans-timeout", str(CLUSTER_KV_TIMEOUT_S))
    config = write_config(tmp_path_factory.mktemp("cluster") / "ms_coordinator.json",
                          [prefill.address], [decode.address], model_dir)
    coordinator = start_coordinator(config)
    yield Cluster(coordinator.address, prefill, decode, coordinator, model_dir)
    for proc in (coordinator, prefill, decode):
        proc.stop()


@pytest.fixture(scope="session")
def http(cluster: Cluster) -> httpx.Client:
    with cluster.client() as client:
        yield client


@pytest.fixture(scope="session")
def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)


class BackgroundStream:
    """A streaming POST read on a thread, so a test can act on servers while it runs."""

    def __init__(self, url: str, body: dict):
        self.raw = b""
        self.ended_at: float | None = None
        self.first_chunk = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url, body))
        self._thread.start()

    def _read(self, url: str, body: dict) -> None:
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", url, json=body) as r:
                for part in r.iter_raw():
                    self.raw += part
                    self.first_chunk.set()
        self.ended_at = time.monotonic()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def sse_events(raw: bytes) -> list[str]:
    """Split an SSE body into the payloads of its `data:` events, checking the framing."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), "an SSE stream must end with a blank line"
    events = text[:-2].split("\n\n")
    payloads = []
    for event in events:
        assert event.startswith("data: "), f"not an SSE data event: {event!r}"
        assert "\n" not in event, f"an event spans lines: {event!r}"
        payloads.append(event[len("data: "):])
    return payloads
