"""What the coordinator sustains and the latency it adds, against clients that call the workers directly.

    .venv/bin/python bench/coordinator.py [--concurrency 1 8 32 128] [--seconds 5] [--max-tokens 32]

Simulated workers (`pdserve worker --simulate`, near-zero cost: no model in the way) serve both
paths, pinned off the first core. The coordinator runs pinned to the first core, its streaming
HTTP clients (aiohttp) beside the workers. Baseline: the same requests made straight to the
workers over gRPC from the first core, the way the coordinator's pipeline makes them (open the
Decode stream, then Prefill naming the decode worker, then read the tokens), through
coordinator/worker_client.py. Each level is a closed loop: `concurrency` clients each send their
next streaming request as soon as the last one ends, for `--seconds`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from coordinator.request import GenerationRequest, SamplingOptions  # noqa: E402
from coordinator.worker_client import WorkerClient  # noqa: E402

PROMPT = "Tell me a story about a lighthouse keeper who counts the ships that pass at night"


@dataclass
class Sample:
    ttft_s: float
    e2e_s: float
    tokens: int


class Process:
    """A pdserve process started for the benchmark; `address` comes from its ready line."""

    def __init__(self, argv: list[str], ready_prefix: str, cpus: set[int]):
        # Pinned before it starts (taskset execs it), so every thread it ever starts stays on `cpus`.
        pin = ["taskset", "-c", ",".join(map(str, sorted(cpus)))]
        self.proc = subprocess.Popen(pin + argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        for line in self.proc.stdout:
            if line.startswith(ready_prefix):
                self.address = line.split()[-1].split("=", 1)[-1]
                break
        else:
            raise RuntimeError(f"{argv} exited with {self.proc.wait()}")
        # Keep draining its output so a chatty process never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def pin_self(cpus: set[int]) -> None:
    """Move every thread of this process (grpc starts its own) onto `cpus`."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that just ended
            pass


def pdserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher.cli", *args]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def closed_loop(one, concurrency: int, seconds: float) -> tuple[list[Sample], float]:
    """`concurrency` clients, each sending its next request when the last ends, until `seconds` pass."""
    samples: list[Sample] = []
    deadline = time.perf_counter() + seconds

    async def client():
        while time.perf_counter() < deadline:
            samples.append(await one())

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return samples, time.perf_counter() - start


def coordinator_request(session: aiohttp.ClientSession, max_tokens: int):
    body = {"model": "pdserve-tiny", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True}

    async def one() -> Sample:
        start = time.perf_counter()
        ttft, tokens = None, 0
        async with session.post("/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"coordinator answered {resp.status}: {await resp.text()}")
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if ttft is None:
                    ttft = time.perf_counter() - start
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        return Sample(ttft, time.perf_counter() - start, tokens)

    return one


def direct_request(client: WorkerClient, prefill: list[str], decode: list[str], prompt_len: int, max_tokens: int):
    """The coordinator pipeline's calls, made by the client itself: round robin, as the coordinator routes."""
    pairs = itertools.cycle(list(zip(prefill, decode)))
    prompt = list(range(1, prompt_len + 1))

    async def one() -> Sample:
        p, d = next(pairs)
        request = GenerationRequest(uuid.uuid4().hex, prompt, SamplingOptions(temperature=0.0), max_tokens)
        start = time.perf_counter()
        call = client.open_decode(d, request, max_tokens, 4096, 60)
        accepted = await call.read()
        prefill_task = asyncio.create_task(client.prefill(
            p, request, max_tokens, d, 60, kv_data_address=accepted.kv_data_address,
            kv_transfer_token=accepted.kv_transfer_token))
        ttft, tokens = None, 0
        while (event := await call.read()) is not None:
            if ttft is None:
                ttft = time.perf_counter() - start
            tokens += 1
            if event.finish_reason is not None:
                break
        await prefill_task
        return Sample(ttft, time.perf_counter() - start, tokens)

    return one


def write_config(path: Path, prefill: list[str], decode: list[str]) -> Path:
    path.write_text(json.dumps({
        "http_config": {"predict_ip": "127.0.0.1", "predict_port": 0, "manage_port": 0},
        "model_config": {"modelName": "pdserve-tiny"},
        "instances": {"prefill": [{"address": a} for a in prefill], "decode": [{"address": a} for a in decode]},
        "digs_scheduler_config": {"algorithm_type": "round_robin"},
    }))
    return path


async def measure(args, coordinator: Process, prefill: list[str], decode: list[str],
                  cpus: dict[str, set[int]]) -> list[tuple]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(coordinator.address, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post("/v1/completions", json={"model": "pdserve-tiny", "prompt": PROMPT,
                                                         "max_tokens": 1}) as resp:
            prompt_len = (await resp.json())["usage"]["prompt_tokens"]
        client = WorkerClient()
        paths = {"direct gRPC (baseline)": direct_request(client, prefill, decode, prompt_len, args.max_tokens),
                 "through the coordinator": coordinator_request(session, args.max_tokens)}
        rows = []
        for concurrency in args.concurrency:
            for name, one in paths.items():
                pin_self(cpus[name])
                await closed_loop(one, concurrency, min(1.0, args.seconds))  # warm up: channels, connections
                cpu0 = coordinator.cpu_seconds()
                samples, elapsed = await closed_loop(one, concurrency, args.seconds)
                cpu = (coordinator.cpu_seconds() - cpu0) / elapsed
                assert all(s.tokens == args.max_tokens for s in samples), "a request came back short"
                rows.append((concurrency, name, samples, elapsed, cpu))
                print(f"{name} c={concurrency}: {len(samples) / elapsed:.0f} req/s, coordinator CPU {cpu:.0%}",
                      file=sys.stderr)
        await client.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured time per level and path")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2, help="simulated prefill and decode workers, each")
    parser.add_argument("--decode-step-ms", type=float, default=1.0, help="the simulated decode step's cost")
    args = parser.parse_args()

    cores = sorted(os.sched_getaffinity(0))
    coordinator_cpus, other_cpus = {cores[0]}, set(cores[1:]) or {cores[0]}
    # The direct client does the coordinator's gRPC work itself, so it gets the coordinator's core; the
    # HTTP client of the coordinator path shares the workers' cores.
    cpus = {"direct gRPC (baseline)": coordinator_cpus, "through the coordinator": other_cpus}
    sim = ("--simulate", "--sim-prefill-base-ms", "0", "--sim-prefill-ms-per-token", "0", "--sim-decode-base-ms",
           str(args.decode_step_ms), "--sim-decode-ms-per-seq", "0", "--max-running", "4096", "--metrics-port", "-1")
    roles = ["prefill"] * args.workers + ["decode"] * args.workers
    with ThreadPoolExecutor(len(roles)) as pool:
        workers = list(pool.map(lambda role: Process(pdserve("worker", "--role", role, "--port", "0", *sim),
                                                         "pdserve worker ready:", other_cpus), roles))
    prefill = [w.address for w in workers[: args.workers]]
    decode = [w.address for w in workers[args.workers:]]
    with tempfile.TemporaryDirectory() as tmp:
        config = write_config(Path(tmp) / "ms_coordinator.json", prefill, decode)
        coordinator = Process(pdserve("coordinator", "--config", str(config)), "pdserve coordinator ready:",
                              coordinator_cpus)
        try:
            rows = asyncio.run(measure(args, coordinator, prefill, decode, cpus))
        finally:
            for process in (coordinator, *workers):
                process.stop()

    print(f"\n{args.workers} simulated prefill + {args.workers} simulated decode workers (prefill 0 ms, decode step "
          f"{args.decode_step_ms} ms), {args.max_tokens} streamed tokens per request, a closed loop of "
          f"{args.seconds:g} s per row. CPU {cores[0]}: the coordinator, or the direct client in its place; "
          f"CPU {sorted(other_cpus)}: the workers (and the coordinator's HTTP client). Latencies in ms; (x) = vs the "
          f"direct gRPC baseline at the same concurrency.\n")
    print("| concurrency | path | requests/s | tokens/s | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 "
          "| coordinator CPU | coordinator CPU ms / request |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    baseline = {}
    for concurrency, name, samples, elapsed, cpu in rows:
        stats = {
            "rps": len(samples) / elapsed,
            "tps": sum(s.tokens for s in samples) / elapsed,
            "ttft50": percentile([s.ttft_s for s in samples], 0.5) * 1000,
            "ttft99": percentile([s.ttft_s for s in samples], 0.99) * 1000,
            "e2e50": percentile([s.e2e_s for s in samples], 0.5) * 1000,
            "e2e99": percentile([s.e2e_s for s in samples], 0.99) * 1000,
        }
        base = baseline.setdefault(concurrency, stats)
        cells = [f"{stats[k]:.0f} ({stats[k] / base[k]:.2f}x)" if k in ("rps", "tps")
                 else f"{stats[k]:.1f} ({stats[k] / base[k]:.2f}x)" for k in stats]
        if name.startswith("direct"):
            cells += ["-", "-"]
        else:  # how busy its one core was, and what each request cost it: the headroom left
            cells += [f"{cpu:.0%}", f"{cpu * 1000 / stats['rps']:.1f}"]
        print(f"| {concurrency} | {name} | " + " | ".join(cells) + " |")
    print(f"\nmedian requests per row: {statistics.median(len(r[2]) for r in rows):.0f}")


if __name__ == "__main__":
    main()
