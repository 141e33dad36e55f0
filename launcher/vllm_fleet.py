"""vLLM instances as `pdserve up`'s workers (`--engine vllm`): their command lines and their instance entries.

Each instance runs launcher/vllm_serve.py under the vLLM venv's Python (made by `make vllm-env`): a prefill
instance as NIXL kv_producer, a decode instance as kv_consumer, each on its own free HTTP and NIXL side-channel
port, its KV events on an ipc:// socket in the run folder (nothing listens beyond this machine), its OMP threads
on a core of its own where there are enough. The worker secret is its API key; with `--tls` it serves https
with the server certificate and asks the coordinator for its client one.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVE_SCRIPT = Path(__file__).resolve().parent / "vllm_serve.py"
VENV_ENV = "PDSERVE_VLLM_VENV"


def lora_flags(loras: tuple[tuple[str, str], ...], max_rank: int = 16) -> tuple[str, ...]:
    """`vllm serve` flags serving `loras` ((name, folder), from `pdserve up --lora`) on every instance: LoRA on, the
    adapters by name, room for them all in one batch; none without adapters (LoRA costs vLLM's base requests
    too). `--worker-args` comes after them, so a flag given there wins."""
    if not loras:
        return ()
    return ("--enable-lora", "--max-loras", str(max(4, len(loras))), "--max-lora-rank", str(max_rank),
            "--lora-modules", *(f"{name}={os.path.abspath(path)}" for name, path in loras))


def default_vllm_venv() -> Path:
    """$PDSERVE_VLLM_VENV, else .vllm-venv at the repository root (`make vllm-env` makes it)."""
    return Path(os.environ.get(VENV_ENV) or REPO / ".vllm-venv")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, for a process that binds it later: taken below the kernel's ephemeral range, so that no
    socket bound to port 0 meanwhile takes it (a vLLM instance's own ZMQ sockets took a NIXL side-channel port
    picked by binding 0 before the instance bound it)."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class VllmInstance:
    """One vLLM instance to start: its role, ports and KV events socket."""

    role: str
    index: int
    port: int
    side_channel_port: int
    kv_events: str

    def argv(self, venv: Path, model_dir: str, api_key_file: str = "", tls_dir: Path | None = None,
             extra: tuple[str, ...] = (), verbose: bool = False, served_name: str = "") -> list[str]:
        """The command that starts it (launcher/vllm_serve.py under the vLLM venv); `served_name`: the `model` its
        own clients pass (the folder's path when empty)."""
        python = venv / "bin" / "python"
        if not python.exists():
            raise ValueError(f"{python} does not exist: make the vLLM environment first (`make vllm-env`)")
        cores = str(self.index % (os.cpu_count() or 1))
        argv = [str(python), str(SERVE_SCRIPT), "--role", self.role, "--model", model_dir, "--port", str(self.port),
                "--side-channel-port", str(self.side_channel_port), "--kv-events", self.kv_events, "--cores", cores]
        if api_key_file:
            argv += ["--api-key-file", api_key_file]
        if served_name:
            argv += ["--served-model-name", served_name]
        if tls_dir is not None:
            argv += ["--ssl-certfile", str(tls_dir / "server.pem"), "--ssl-keyfile", str(tls_dir / "server-key.pem"),
                     "--ssl-ca-certs", str(tls_dir / "ca.pem")]
        if verbose:
            argv.append("--verbose")
        return argv + (["--", *extra] if extra else [])

    def entry(self, scheme: str) -> dict:
        """Its entry in ms_coordinator.json's instances."""
        return {"engine": "vllm", "url": f"{scheme}://127.0.0.1:{self.port}", "kv_events": self.kv_events,
                "device": "cpu"}


def plan_instances(num_prefill: int, num_decode: int, run_dir: Path) -> list[VllmInstance]:
    """Prefill instances first, then decode ones, each with free ports of its own."""
    roles = ["prefill"] * num_prefill + ["decode"] * num_decode
    return [VllmInstance(role, i, free_port(), free_port(), f"ipc://{run_dir / f'kv-events-{role}-{i}'}")
            for i, role in enumerate(roles)]
