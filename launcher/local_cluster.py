"""`pdserve up`: a coordinator and K prefill + K decode workers as processes on 127.0.0.1.

Each child is its own OS process whose command line names its role, started with a parent
death signal so none outlives this launcher, and stopped with SIGTERM (then SIGKILL) on exit.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from launcher.cluster_security import ClusterSecurity

HOST = "127.0.0.1"
START_TIMEOUT_S = 180.0
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class ClusterOptions:
    """What `pdserve up` was asked to start."""

    config: str | None = None
    predict_port: int | None = None
    num_prefill: int = 1
    num_decode: int = 1
    model: str | None = None
    log_level: str | None = None
    tls_dir: str | None = None  # --tls DIR: mutual TLS on every link, certificates made in DIR if absent
    api_keys_file: str | None = None  # --api-keys FILE: SHA-256 digests of the accepted API keys


def pdserve_command() -> list[str]:
    """How to start `pdserve` again, so children show up as `pdserve worker --role ...`."""
    script = Path(sys.executable).with_name("pdserve")
    return [sys.executable, str(script)] if script.exists() else [sys.executable, "-m", "launcher.cli"]


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Child:
    """A started pdserve process and the address it announced."""

    def __init__(self, name: str, argv: list[str], ready_prefix: str):
        self.name = name
        self.ready_prefix = ready_prefix
        self.address = ""
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)

    def wait_ready(self) -> str:
        """Block until the child prints its ready line; return the address it announced."""
        for line in self.proc.stdout:
            if line.startswith(self.ready_prefix):
                self.address = line.strip().rsplit(" ", 1)[-1].split("=", 1)[-1]
                threading.Thread(target=self._relay, daemon=True).start()
                return self.address
            sys.stdout.write(line)
        raise RuntimeError(f"{self.name} exited with code {self.proc.wait()} before it was ready")

    def _relay(self) -> None:
        for line in self.proc.stdout:
            sys.stdout.write(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)


def _wait_healthy(url: str, timeout_s: float, context=None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2, context=context) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy within {timeout_s}s")


def _cluster_config(options: ClusterOptions, prefill: list[str], decode: list[str], model_dir: str,
                    security: ClusterSecurity) -> dict:
    from coordinator.config import load_config

    base = load_config(options.config).model_dump(by_alias=True) if options.config else {}
    base.setdefault("http_config", {"predict_ip": HOST, "predict_port": 1025})
    base["http_config"]["predict_ip"] = HOST
    if options.predict_port is not None:
        base["http_config"]["predict_port"] = options.predict_port
        if not options.config:
            base["http_config"]["manage_port"] = 0  # beside a chosen port, let the system pick one
    base.setdefault("model_config", {})
    base["model_config"]["modelWeightPath"] = model_dir
    base["instances"] = {"prefill": [{"address": a} for a in prefill], "decode": [{"address": a} for a in decode]}
    for section, values in security.coordinator_sections().items():
        base.setdefault(section, {}).update(values)
    return base


def run_local_cluster(options: ClusterOptions) -> int:
    """Start everything, print `pdserve ready: URL`, and stop everything on SIGTERM/SIGINT."""
    stop = threading.Event()
    starting = True

    def on_signal(*_):
        stop.set()
        if starting:  # interrupt a blocking start-up wait; the finally block stops the children
            raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    children: list[Child] = []
    # SIGHUP to the launcher reloads the whole cluster's certificates, keys and secrets.
    signal.signal(signal.SIGHUP, lambda *_: [c.proc.send_signal(signal.SIGHUP) for c in children
                                             if c.proc.poll() is None])

    model_dir = options.model
    if model_dir is None and options.config:
        from coordinator.config import load_config

        model_dir = load_config(options.config).model_settings.modelWeightPath or None
    if model_dir is None:
        from embedded_model import default_model_dir, ensure_default_model

        print(f"pdserve: preparing the embedded model in {default_model_dir()} ...", flush=True)
        model_dir = str(ensure_default_model())

    base = pdserve_command() + (["--log-level", options.log_level] if options.log_level else [])
    config_file = None
    run_dir = tempfile.TemporaryDirectory(prefix="pdserve-run-")
    try:
        security = ClusterSecurity.prepare(Path(run_dir.name), options.tls_dir, options.api_keys_file)
        for role, count in (("prefill", options.num_prefill), ("decode", options.num_decode)):
            for i in range(count):
                argv = base + ["worker", "--role", role, "--model", model_dir, "--host", HOST, "--port", "0",
                               "--security-config", str(security.worker_security_file)]
                children.append(Child(f"{role} worker {i}", argv, "pdserve worker ready:"))
        print(f"pdserve: starting {len(children)} workers ...", flush=True)
        for child in children:
            child.wait_ready()
        prefill = [c.address for c in children if c.name.startswith("prefill")]
        decode = [c.address for c in children if c.name.startswith("decode")]
        fd, config_file = tempfile.mkstemp(prefix="pdserve-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(_cluster_config(options, prefill, decode, model_dir, security), f, indent=2)
        print("pdserve: starting coordinator ...", flush=True)
        coordinator = Child("coordinator", base + ["coordinator", "--config", config_file], "pdserve coordinator ready:")
        children.append(coordinator)
        coordinator.wait_ready()
        _wait_healthy(coordinator.address, START_TIMEOUT_S, security.client_ssl_context())
        print(f"pdserve ready: {coordinator.address}", flush=True)
        starting = False

        while not stop.wait(0.5):
            dead = [c for c in children if c.proc.poll() is not None]
            if dead:
                print(f"pdserve: {dead[0].name} exited with code {dead[0].proc.returncode}; stopping", file=sys.stderr)
                return 1
        return 0
    except (RuntimeError, ValueError) as exc:  # a child that would not start; a --tls folder it cannot complete
        print(f"pdserve: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        _stop_all(children)
        if config_file:
            os.unlink(config_file)
        run_dir.cleanup()


def _stop_all(children: list[Child]) -> None:
    # Coordinator first, so no new work reaches workers that are about to go.
    for child in reversed(children):
        child.stop()
    deadline = time.monotonic() + STOP_GRACE_S
    for child in reversed(children):
        try:
            child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()
