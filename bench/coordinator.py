"""What the coordinator sustains and the latency it adds, against clients that call the workers directly.

    .venv/bin/python bench/coordinator.py [--concurrency 1 8 32 128] [--seconds 5] [--max-tokens 32]
                                          [--no-tls | --plain-kv]

Simulated workers (`pdserve worker --simulate`, near-zero cost: no model in the way) serve both
paths, pinned off the first core. The coordinator runs pinned to the first core, its streaming
HTTP clients (aiohttp) beside the workers. Baseline: the same requests made straight to the
workers over gRPC from the first core, the way the coordinator's pipeline makes them (open the
Decode stream, then Prefill naming the decode worker, then read the tokens), through
coordinator/worker_client.py. Each level is a closed loop: `concurrency` clients each send their
next streaming request as soon as the last one ends, for `--seconds`.

Unless `--no-tls`, a second cluster speaks mutual TLS on every link the requests use, as `pdserve up
--tls` sets it up (certificates from security/certificates.py): clients -> predict port (aiohttp
with the CA and a client certificate, kept-alive connections), coordinator -> workers' gRPC, and
prefill -> decode KV over raw TCP. Its rows run beside the plaintext ones at each level, and a second
table gives what TLS costs: CPU per request and requests/s against plaintext in the same run.
`--plain-kv` leaves the KV link of that cluster in plaintext, which tells the coordinator's own
cost of TLS apart from what a handshake per KV transfer costs the workers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import ssl
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
from security.certificates import ensure_local_certificates  # noqa: E402
from security.settings import TlsLink  # noqa: E402
from security.tls import LinkTls  # noqa: E402

PROMPT = "Tell me a story about a lighthouse keeper who counts the ships that pass at night"
BASELINE = "direct gRPC (baseline)"
THROUGH = "through the coordinator"
TLS = ", mutual TLS"
PLAIN_KV = " (KV in plaintext)"


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


def tls_link(cert_dir: Path, leaf: str) -> dict:
    """One link's mutual TLS, presenting `leaf`.pem (as launcher/cluster_security.py writes it)."""
    return {"tls_enable": True, "mutual_tls": True, "ca_cert": str(cert_dir / "ca.pem"),
            "tls_cert": str(cert_dir / f"{leaf}.pem"), "tls_key": str(cert_dir / f"{leaf}-key.pem")}


def write_config(path: Path, prefill: list[str], decode: list[str], cert_dir: Path | None = None) -> Path:
    config = {
        "http_config": {"predict_ip": "127.0.0.1", "predict_port": 0, "manage_port": 0},
        "model_config": {"modelName": "pdserve-tiny"},
        "instances": {"prefill": [{"address": a} for a in prefill], "decode": [{"address": a} for a in decode]},
        "digs_scheduler_config": {"algorithm_type": "round_robin"},
    }
    if cert_dir is not None:  # serves clients with the server certificate, dials workers with the client one
        config["tls_config"] = {"predict": tls_link(cert_dir, "server"), "worker_grpc": tls_link(cert_dir, "client")}
    path.write_text(json.dumps(config))
    return path


@dataclass
class Cluster:
    """Simulated workers and a coordinator in front of them, plaintext or mutual TLS throughout."""

    suffix: str  # added to the path names of its rows
    workers: list[Process]
    prefill: list[str]
    decode: list[str]
    coordinator: Process | None = None
    client_ssl: ssl.SSLContext | None = None  # what its HTTP clients present to the predict port
    worker_tls: LinkTls | None = None  # what the direct baseline presents to the workers

    def stop(self) -> None:
        for process in (self.coordinator, *self.workers):
            if process is not None:
                process.stop()


def start_cluster(args, tmp: Path, cert_dir: Path | None, cpus: dict[str, set[int]]) -> Cluster:
    sim = ("--simulate", "--sim-prefill-base-ms", "0", "--sim-prefill-ms-per-token", "0", "--sim-decode-base-ms",
           str(args.decode_step_ms), "--sim-decode-ms-per-seq", "0", "--max-running", "4096", "--metrics-port", "-1")
    suffix = (TLS + PLAIN_KV if args.plain_kv else TLS) if cert_dir is not None else ""
    tls_worker_links = ("worker_grpc",) if args.plain_kv else ("worker_grpc", "kv_transfer")
    if cert_dir is not None:
        # Workers serve gRPC and KV with the server certificate and dial KV with it too.
        security = tmp / "workers.json"
        security.write_text(json.dumps({"tls_config": {link: tls_link(cert_dir, "server")
                                                       for link in tls_worker_links}}))
        sim += ("--security-config", str(security))
    roles = ["prefill"] * args.workers + ["decode"] * args.workers
    with ThreadPoolExecutor(len(roles)) as pool:
        workers = list(pool.map(lambda role: Process(pdserve("worker", "--role", role, "--port", "0", *sim),
                                                         "pdserve worker ready:", cpus[THROUGH]), roles))
    cluster = Cluster(suffix, workers, [w.address for w in workers[: args.workers]],
                      [w.address for w in workers[args.workers:]])
    try:
        config = write_config(tmp / f"ms_coordinator{'-tls' if suffix else ''}.json", cluster.prefill, cluster.decode,
                              cert_dir)
        cluster.coordinator = Process(pdserve("coordinator", "--config", str(config)), "pdserve coordinator ready:",
                                      cpus[BASELINE])
    except BaseException:
        cluster.stop()
        raise
    if cert_dir is not None:
        cluster.client_ssl = ssl.create_default_context(cafile=str(cert_dir / "ca.pem"))
        cluster.client_ssl.load_cert_chain(str(cert_dir / "client.pem"), str(cert_dir / "client-key.pem"))
        cluster.worker_tls = LinkTls("tls_config.worker_grpc", TlsLink(**tls_link(cert_dir, "client")), "client")
    return cluster


async def measure(args, clusters: list[Cluster], cpus: dict[str, set[int]]) -> list[tuple]:
    async with contextlib.AsyncExitStack() as stack:
        paths = {}
        for cluster in clusters:
            connector = aiohttp.TCPConnector(limit=0, ssl=cluster.client_ssl or True)
            session = await stack.enter_async_context(aiohttp.ClientSession(
                cluster.coordinator.address, connector=connector, timeout=aiohttp.ClientTimeout(total=120)))
            async with session.post("/v1/completions", json={"model": "pdserve-tiny", "prompt": PROMPT,
                                                             "max_tokens": 1}) as resp:
                prompt_len = (await resp.json())["usage"]["prompt_tokens"]
            client = WorkerClient(cluster.worker_tls)
            stack.push_async_callback(client.close)
            paths[BASELINE + cluster.suffix] = (direct_request(client, cluster.prefill, cluster.decode, prompt_len,
                                                               args.max_tokens), cpus[BASELINE], cluster)
            paths[THROUGH + cluster.suffix] = (coordinator_request(session, args.max_tokens), cpus[THROUGH], cluster)
        rows = []
        for concurrency in args.concurrency:
            for name, (one, path_cpus, cluster) in paths.items():
                pin_self(path_cpus)
                await closed_loop(one, concurrency, min(1.0, args.seconds))  # warm up: channels, connections
                cpu0 = cluster.coordinator.cpu_seconds()
                samples, elapsed = await closed_loop(one, concurrency, args.seconds)
                cpu = (cluster.coordinator.cpu_seconds() - cpu0) / elapsed
                assert all(s.tokens == args.max_tokens for s in samples), "a request came back short"
                rows.append((concurrency, name, samples, elapsed, cpu))
                print(f"{name} c={concurrency}: {len(samples) / elapsed:.0f} req/s, coordinator CPU {cpu:.0%}",
                      file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured time per level and path")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2, help="simulated prefill and decode workers, each")
    parser.add_argument("--decode-step-ms", type=float, default=1.0, help="the simulated decode step's cost")
    tls = parser.add_mutually_exclusive_group()
    tls.add_argument("--no-tls", action="store_true", help="plaintext rows only (no mutual-TLS cluster)")
    tls.add_argument("--plain-kv", action="store_true", help="the TLS cluster moves KV (prefill -> decode) in "
                     "plaintext: TLS on the client and coordinator -> worker links only")
    args = parser.parse_args()

    cores = sorted(os.sched_getaffinity(0))
    coordinator_cpus, other_cpus = {cores[0]}, set(cores[1:]) or {cores[0]}
    # The direct client does the coordinator's gRPC work itself, so it gets the coordinator's core; the
    # HTTP client of the coordinator path shares the workers' cores.
    cpus = {BASELINE: coordinator_cpus, THROUGH: other_cpus}
    clusters: list[Cluster] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            clusters.append(start_cluster(args, Path(tmp), None, cpus))
            if not args.no_tls:
                cert_dir = ensure_local_certificates(Path(tmp) / "tls")
                clusters.append(start_cluster(args, Path(tmp), cert_dir, cpus))
            rows = asyncio.run(measure(args, clusters, cpus))
        finally:
            for cluster in clusters:
                cluster.stop()

    print(f"\n{args.workers} simulated prefill + {args.workers} simulated decode workers (prefill 0 ms, decode step "
          f"{args.decode_step_ms} ms), {args.max_tokens} streamed tokens per request, a closed loop of "
          f"{args.seconds:g} s per row. CPU {cores[0]}: the coordinator, or the direct client in its place; "
          f"CPU {sorted(other_cpus)}: the workers (and the coordinator's HTTP client). Latencies in ms; (x) = vs the "
          f"direct gRPC baseline (plaintext) at the same concurrency.\n")
    print("| concurrency | path | requests/s | tokens/s | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 "
          "| coordinator CPU | coordinator CPU ms / request |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    baseline = {}
    measured = {}
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
        measured[concurrency, name] = stats | {"cpu_ms": cpu * 1000 / stats["rps"]}
        cells = [f"{stats[k]:.0f} ({stats[k] / base[k]:.2f}x)" if k in ("rps", "tps")
                 else f"{stats[k]:.1f} ({stats[k] / base[k]:.2f}x)" for k in stats]
        if name.startswith("direct"):
            cells += ["-", "-"]
        else:  # how busy its one core was, and what each request cost it: the headroom left
            cells += [f"{cpu:.0%}", f"{cpu * 1000 / stats['rps']:.1f}"]
        print(f"| {concurrency} | {name} | " + " | ".join(cells) + " |")
    print(f"\nmedian requests per row: {statistics.median(len(r[2]) for r in rows):.0f}")
    if not args.no_tls:
        print_tls_costs(args.concurrency, measured, args.plain_kv)


def print_tls_costs(levels: list[int], measured: dict, plain_kv: bool) -> None:
    """Each path over mutual TLS against the same path in plaintext, same run."""
    kv = "KV in plaintext" if plain_kv else "KV over TCP"
    print(f"\nMutual TLS vs plaintext, same run (clients -> predict port, coordinator -> workers' gRPC, {kv}):\n")
    print("| concurrency | path | requests/s, TLS | vs plaintext | coordinator CPU ms / request, TLS | vs plaintext "
          "| TTFT p50, TLS | vs plaintext | e2e p50, TLS | vs plaintext |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for concurrency in levels:
        for label, name in (("direct gRPC", BASELINE), (THROUGH, THROUGH)):
            plain = measured[concurrency, name]
            tls = measured[concurrency, name + TLS + (PLAIN_KV if plain_kv else "")]
            cpu = "- | -" if name == BASELINE else f"{tls['cpu_ms']:.1f} | {tls['cpu_ms'] / plain['cpu_ms']:.2f}x"
            print(f"| {concurrency} | {label} | {tls['rps']:.0f} | {tls['rps'] / plain['rps']:.2f}x | {cpu} "
                  f"| {tls['ttft50']:.1f} | {tls['ttft50'] / plain['ttft50']:.2f}x "
                  f"| {tls['e2e50']:.1f} | {tls['e2e50'] / plain['e2e50']:.2f}x |")


if __name__ == "__main__":
    main()
