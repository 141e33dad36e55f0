"""Many simulated workers in one process: `--prefill` prefill and `--decode` decode gRPC servers, each with its own
engine and port, as `pdserve worker --simulate` builds them (metrics off), for fleets too large for a process each.

    .venv/bin/python bench/sim_fleet.py --prefill 128 --decode 128 [--max-running 4096] [--sim-* as pdserve worker]

Prints one line, `sim fleet ready: prefill=HOST:PORT,... decode=HOST:PORT,...`, once every server listens; SIGTERM or
SIGINT ends the process at once (no drain).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.cli import run_event_loop  # noqa: E402
from launcher.simulated_worker import add_simulation_flags, simulated_backend  # noqa: E402
from worker.service.options import WorkerOptions  # noqa: E402
from worker.service.serve import serve  # noqa: E402

READY = "pdserve worker ready:"


class ReadyLines(io.TextIOBase):
    """Stands in for stdout while the workers start: collects each one's ready line (its only way to tell its port)."""

    def __init__(self, expected: int):
        self.addresses: dict[str, list[str]] = {"prefill": [], "decode": []}
        self.expected = expected
        self.all_ready = asyncio.Event()

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line.startswith(READY):  # pdserve worker ready: role=R address=A
                role, address = (field.split("=", 1)[1] for field in line.split()[-2:])
                self.addresses[role].append(address)
        if sum(map(len, self.addresses.values())) == self.expected:
            self.all_ready.set()
        return len(text)


async def run(args: argparse.Namespace) -> None:
    backend = simulated_backend(args)
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    ready = ReadyLines(len(roles))
    with contextlib.redirect_stdout(ready):
        workers = asyncio.gather(*(serve(WorkerOptions(role=role, backend=backend, host=args.host,
                                                       max_running=args.max_running, metrics_port=-1,
                                                       token_channel_port=args.token_channel_port))
                                   for role in roles))
        waiting = asyncio.ensure_future(ready.all_ready.wait())
        await asyncio.wait([workers, waiting], return_when=asyncio.FIRST_COMPLETED)
    if not ready.all_ready.is_set():
        waiting.cancel()
        await workers  # a worker that failed to start: its exception
        raise RuntimeError("the workers stopped before all were ready")
    # Each serve() installed its own SIGTERM handler, the last one replacing the others, and none of them can reach
    # the servers from here to stop them in order: a benchmark's fleet has nothing to drain, so exit at once.
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, os._exit, 0)
    print(f"sim fleet ready: prefill={','.join(ready.addresses['prefill'])} "
          f"decode={','.join(ready.addresses['decode'])}", flush=True)
    await workers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=1, help="simulated prefill workers")
    parser.add_argument("--decode", type=int, default=1, help="simulated decode workers")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--max-running", type=int, default=64, help="sequences per decode step, per decode worker")
    parser.add_argument("--token-channel-port", type=int, default=0, help="0: each decode worker picks one; -1: none")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    add_simulation_flags(parser)
    args = parser.parse_args()
    run_event_loop(run(args))  # as `pdserve worker` runs


if __name__ == "__main__":
    main()
