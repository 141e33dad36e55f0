"""vLLM instances as `pdserve up`'s workers (`--engine vllm`): their command lines and their instance entries.

Each instance runs launcher/vllm_serve.py under the vLLM venv's Python (made by `make vllm-env`): a prefill
instance as NIXL kv_producer, a decode instance as kv_consumer, each on its own free HTTP and NIXL side-channel
port, its KV events on an ipc:// socket in the run folder (nothing listens beyond this machine), its OMP threads
on a core of its own where there are enough. The worker secret is its API key; with `--tls` it serves https
with the server certificate and asks the coordinator for its client one. With `--speculative`, each decode instance
drafts by vLLM's own speculative decoding (`speculative_config`); prefill instances never do.
"""

from __future__ import annotations

import json
import os
import random
import socket
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVE_SCRIPT = Path(__file__).resolve().parent / "vllm_serve.py"
VENV_ENV = "PDSERVE_VLLM_VENV"
# vLLM's suffix decoding imports this compiled module of arctic-inference (`VLLM_ENV_SUFFIX=1 make vllm-env`).
ARCTIC_SUFFIX_MODULE = "arctic_inference/suffix_decoding/_C*.so"


def lora_flags(loras: tuple[tuple[str, str], ...], max_rank: int = 16) -> tuple[str, ...]:
    """`vllm serve` flags serving `loras` ((name, folder), from `pdserve up --lora`) on every instance: LoRA on, the
    adapters by name, room for them all in one batch; none without adapters (LoRA costs vLLM's base requests
    too). `--worker-args` comes after them, so a flag given there wins."""
    if not loras:
        return ()
    return ("--enable-lora", "--max-loras", str(max(4, len(loras))), "--max-lora-rank", str(max_rank),
            "--lora-modules", *(f"{name}={os.path.abspath(path)}" for name, path in loras))


def speculative_config(method: str, num_tokens: int | None = None) -> dict:
    """vLLM's `--speculative-config` for a decode instance drafting by `method` (`pdserve up --speculative`): at most
    `num_tokens` drafts a step, else as many as a pdserve decode worker drafts by default; ngram with the n-gram
    lengths a pdserve decode worker looks up by default, so both engines draft alike."""
    from worker.engine.speculative.config import SpeculativeConfig  # a dataclass: no torch

    defaults = SpeculativeConfig(method)
    config = {"method": method, "num_speculative_tokens": num_tokens or defaults.num_speculative_tokens}
    if method == "ngram":
        config.update(prompt_lookup_max=defaults.prompt_lookup_max, prompt_lookup_min=defaults.prompt_lookup_min)
    return config


def speculative_refusal(method: str, venv: Path) -> str:
    """Why the vLLM environment `venv` cannot draft by `method`; empty when it can (or when there is no environment
    at all, which starting an instance reports). vLLM's CPU build runs ngram, and suffix only with arctic-inference
    (docs/operating/vllm-engines.md, Speculative decoding)."""
    if method == "ngram" or not (venv / "bin" / "python").exists():
        return ""
    if method == "suffix":
        if any(venv.glob(f"lib/python3*/site-packages/{ARCTIC_SUFFIX_MODULE}")):
            return ""
        return (f"vLLM's suffix decoding needs the arctic-inference package, which the vLLM environment {venv} "
                "lacks (vLLM fails at start-up: \"Arctic Inference is required for suffix decoding\"): "
                "`VLLM_ENV_SUFFIX=1 make vllm-env` builds it there, or use --speculative ngram")
    return f"vLLM engines here draft by ngram or suffix, not {method!r}"


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
             extra: tuple[str, ...] = (), verbose: bool = False, served_name: str = "",
             speculative: dict | None = None) -> list[str]:
        """The command that starts it (launcher/vllm_serve.py under the vLLM venv); `served_name`: the `model` its
        own clients pass (the folder's path when empty); `speculative`: vLLM's speculative_config, for a decode
        instance (a prefill instance computes one token a request: it drafts nothing)."""
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
        if speculative and self.role == "decode":
            argv += ["--speculative-config", json.dumps(speculative)]
        if verbose:
            argv.append("--verbose")
        return argv + (["--", *extra] if extra else [])

    def entry(self, scheme: str, speculative: dict | None = None) -> dict:
        """Its entry in ms_coordinator.json's instances (a decode instance started with `speculative` names its
        method: the coordinator then refuses a request's `x-pdserve-speculative: off`, which vLLM cannot honour)."""
        entry = {"engine": "vllm", "url": f"{scheme}://127.0.0.1:{self.port}", "kv_events": self.kv_events,
                 "device": "cpu"}
        if speculative and self.role == "decode":
            entry["speculative"] = speculative["method"]
        return entry


def plan_instances(num_prefill: int, num_decode: int, run_dir: Path) -> list[VllmInstance]:
    """Prefill instances first, then decode ones, each with free ports of its own."""
    roles = ["prefill"] * num_prefill + ["decode"] * num_decode
    return [VllmInstance(role, i, free_port(), free_port(), f"ipc://{run_dir / f'kv-events-{role}-{i}'}")
            for i, role in enumerate(roles)]
