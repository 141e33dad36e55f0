"""What the coordinator costs per streamed request, against a floor measured in the same run: a minimal aiohttp
pass-through proxy in the coordinator's place.

    .venv/bin/python bench/coordinator.py [--max-tokens 64 256] [--concurrency 1 32 128] [--seconds 5]
                                          [--workers 2] [--decode-step-ms 1] [--direct] [--tls | --plain-kv]
                                          [--against DIR|NAME=VALUE] [--repeats N] [--cpu-share F]
    .venv/bin/python bench/coordinator.py --fleet 2 64 256 [--seconds 5] [--fleet-rate R | --fleet-streams-per-decode S]
                                          [--repeats N] [--against DIR|NAME=VALUE] [--cpu-share F]
    (either form) [--algorithm round_robin|load_balance|cache_affinity] [--against-algorithm ...]

Each row is a closed loop of streaming /v1/completions requests at one `--max-tokens` and one concurrency:
`concurrency` clients each send their next request as soon as the last one ends, for `--seconds` (their last
requests included), after a warm-up of 1 s. The clients start staggered over one request's unloaded length (tokens
x decode step): simulated requests of one length step in lockstep, so clients that start together stay a burst.
The clients are bench/stream_client.py: kept-alive HTTP/1.1 connections, one protocol callback per socket read and
the stream parsed once it has ended (an aiohttp client cost the shared core about as much per token as the proxy).

- pass-through (floor): bench/passthrough.py. A mock upstream streams what the coordinator streams (one `data:`
  chunk per token, of the coordinator's chunk size; the first at once, as prefill costs 0 ms here, then one per
  simulated decode step on one clock shared by every stream, as a decode worker's batch steps; then the usage chunk
  and `data: [DONE]`), through a minimal aiohttp proxy (one shared ClientSession; the request body relayed
  upstream, the answer relayed with iter_any() -> StreamResponse.write). Both run on the coordinator's event loop
  (launcher.cli.run_event_loop). What any Python HTTP relay in the coordinator's place pays.
- coordinator: `pdserve coordinator` (round robin) in front of `--workers` simulated prefill and decode workers
  (`pdserve worker --simulate`, a process each: prefill 0 ms, one decode step `--decode-step-ms`, no model).
- direct gRPC (at c=1 always, at every level with `--direct`): no HTTP at all; the bench makes the coordinator pipeline's worker calls itself (open
  the Decode stream, then Prefill naming the decode worker, then read the tokens) via coordinator/workers/client.py.
- `--tls`: a second cluster with mutual TLS on every link the requests use, as `pdserve up --tls` sets it up
  (clients -> predict port, coordinator -> workers' gRPC, prefill -> decode KV over raw TCP); its rows run beside
  the plaintext ones, and a second table gives TLS's cost against plaintext. `--plain-kv` (implies `--tls`)
  leaves the KV link in plaintext, which tells the coordinator's own TLS cost apart from a handshake per transfer.

Pinning: the coordinator and the proxy are started under `taskset -c <first core>` (so every thread they ever
start stays there), and for direct rows the bench moves its own threads there; the workers, the mock upstream and
the HTTP clients (this process) run on the other cores. CPU per request is the pinned process's user + system time
(/proc/PID/stat) over the measured loop, divided by the requests it completed. Summary lines: the coordinator's
CPU/request over the pass-through's at c=32 (target <= 1.5 at 64 and 256 tokens), and the TTFT p50 it adds at c=1 over
the direct gRPC row (target < 1 ms; measured at c=1 always), which makes the same worker calls without it. A request answered with an error, or short of tokens, ends the bench.

`--against` measures what one change buys: a second coordinator in front of the same workers, run from another
checkout (`git worktree add /tmp/base HEAD~1`, then `--against /tmp/base`) or from this one with NAME=VALUE in its
environment; its rows sit beside this one's and a summary line gives the ratio. `--repeats N` runs every row N
times, the paths taking turns, and keeps each row's median: this machine's rows move by 10-20% from run to run, so a
change is judged only against rows from the same stretch of time.

`--tenants` gives the coordinator (not the --against one) an API keys file of 4 tenants, each with a weight and every
limit on (rpm, tpm, concurrency; none reached), and its clients' requests take turns with the 4 keys: `--tenants
--against .` is tenancy's CPU per request against a coordinator without it (target <= 1.1x).

`--speculative` gives the coordinator (not the --against one) speculative_config enabled: every request's output
goes into the draft corpus and, its prompt being the same as every other's, every request is sent the most hints
(max_hints of max_hint_tokens at most), so the corpus is paid for in full (lookups, records, evictions, hints on
the wire): `--speculative --against .` is the corpus's CPU per request against a coordinator without it (target
<= 1.1x).

`--algorithm` sets every coordinator's routing policy (round_robin by default) and `--against-algorithm` the --against
coordinator's: `--against . --against-algorithm cache_affinity` puts a coordinator routing on the KV index (following
the workers' KV events, hashing each prompt) beside a round-robin one in front of the same workers.

`--cpu-share F` holds each pinned process (the proxy, the coordinator, the --against coordinator; not the direct
client) to F of one core with a cgroup CPU quota (root; bench/cpu_quota.py). On this 2-core machine the workers'
core saturates first, so without it the pinned process idles part of the time and pays a wake-up per event that a
busy loop batches: its CPU per request then says how loaded it was as much as what a request costs (here 6.7 ms at
c=8 against 3.7 at c=64 for the same code). Held to a share, every process runs saturated, and CPU per request
is the cost at capacity: what requests/s per core means.

`--fleet N ...` measures instead the coordinator alone, at 64 tokens, in front of N simulated instances (N/2
prefill, N/2 decode, all in one process: bench/sim_fleet.py) for each N, warmed up until every instance has
served a request, and its CPU per request against the smallest fleet's (target: at most 1.2x apart at 64 vs 2).
Every size's fleet and coordinator start at once and the sizes take turns within each of `--repeats` rounds (with
`--against`, so do the two coordinators), so that each median comes from the same minutes as the others.
Every size gets the same offered load, `--fleet-rate` requests started per second (an open loop), so that sizes are
compared and not load levels; `--fleet-rate 0` runs the closed loop of 32 clients instead, and
`--fleet-streams-per-decode S` a closed loop of S clients per decode instance (the same load on each worker, the
coordinator's load growing with the fleet). At capacity
(`--fleet-rate 0 --cpu-share F`), F must be low enough that the fleet's core keeps up at every size (0.25 here:
at 0.5 the 64-instance fleet process saturates the other core first and the coordinator idles again).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import socket
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

from coordinator.requests.request import GenerationRequest, SamplingOptions  # noqa: E402
from coordinator.workers.client import WorkerClient  # noqa: E402
from coordinator.workers.request_messages import sampling_to_pb  # noqa: E402
from bench.cpu_quota import CpuQuota, check_available  # noqa: E402
from bench.stream_client import StreamClient  # noqa: E402
from launcher.cli import run_event_loop  # noqa: E402
from security.api_keys import hash_key  # noqa: E402
from security.certificates import ensure_local_certificates  # noqa: E402
from security.settings import TlsLink  # noqa: E402
from security.tls import LinkTls  # noqa: E402

PROMPT = "Tell me a story about a lighthouse keeper who counts the ships that pass at night"
PASSTHROUGH = "pass-through (floor)"
THROUGH = "coordinator"
BASELINE = "direct gRPC"
TLS = ", mutual TLS"
PLAIN_KV = " (KV in plaintext)"
AGAINST = "coordinator, --against"
TENANT_KEYS = tuple(f"sk-bench-tenant-{i}" for i in range(4))  # --tenants
FLEET_TOKENS, FLEET_CONCURRENCY = 64, 32  # the fleet comparison's one level
CPU_RATIO_TARGET, TTFT_ADDED_TARGET_MS, FLEET_RATIO_TARGET = 1.5, 1.0, 1.2


@dataclass
class Sample:
    ttft_s: float
    e2e_s: float


@dataclass
class Row:
    tokens: int
    concurrency: int
    path: str
    samples: list[Sample]
    elapsed_s: float
    cpu: float  # the pinned process's busy fraction of its core
    server_ttft_ms: float | None = None  # the coordinator's own mean TTFT, from its arrival to the first token

    def mean_ttft_ms(self) -> float:
        return statistics.fmean(s.ttft_s for s in self.samples) * 1000

    @property
    def rps(self) -> float:
        return len(self.samples) / self.elapsed_s

    @property
    def cpu_ms(self) -> float:
        return self.cpu * 1000 / self.rps

    def ttft_ms(self, q: float = 0.5) -> float:
        return percentile([s.ttft_s for s in self.samples], q) * 1000

    def e2e_ms(self, q: float = 0.5) -> float:
        return percentile([s.e2e_s for s in self.samples], q) * 1000


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Process:
    """A process started for the benchmark; `address` (and the whole `ready_line`) come from its ready line."""

    def __init__(self, argv: list[str], ready_prefix: str, cpus: set[int], cwd: Path = REPO,
                 env: dict[str, str] | None = None, share: float | None = None):
        # Pinned before it starts (taskset execs it), so every thread it ever starts stays on `cpus`.
        pin = ["taskset", "-c", ",".join(map(str, sorted(cpus)))]
        self.proc = subprocess.Popen(pin + argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, **env} if env else None)
        self.quota = CpuQuota(share) if share is not None else None  # held to `share` of a core (--cpu-share)
        if self.quota is not None:
            self.quota.add(self.proc.pid)
        output = []
        for line in self.proc.stdout:
            if line.startswith(ready_prefix):
                self.ready_line = line.strip()
                self.address = line.split()[-1].split("=", 1)[-1]
                break
            output.append(line)
        else:
            raise RuntimeError(f"{argv} exited with {self.proc.wait()}:\n{''.join(output[-20:])}")
        # Keep draining its output so a chatty process never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.proc.pid)

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) / 1024

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        if self.quota is not None:
            self.quota.remove()


class ThisProcess:
    """The bench itself, as the pinned process of the direct rows (it does the coordinator's gRPC work there)."""

    def cpu_seconds(self) -> float:
        return cpu_seconds(os.getpid())


def pin_self(cpus: set[int]) -> None:
    """Move every thread of this process (grpc starts its own) onto `cpus`."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that just ended
            pass


def pdserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher.cli", *args]


def bench_script(name: str, *args: str) -> list[str]:
    return [sys.executable, str(REPO / "bench" / name), *args]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def closed_loop(one, concurrency: int, seconds: float, stagger_s: float = 0.0) -> tuple[list[Sample], float]:
    """`concurrency` clients, each sending its next request when the last ends, until `seconds` pass (their last
    requests included). The i-th starts i / `concurrency` of `stagger_s` late: simulated requests of one length step
    in lockstep, so clients that start together would stay a burst forever."""
    samples: list[Sample] = []
    start = time.perf_counter()
    deadline = start + seconds

    async def client(i: int):
        await asyncio.sleep(i * stagger_s / concurrency)
        while time.perf_counter() < deadline:
            samples.append(await one())

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return samples, time.perf_counter() - start


async def open_loop(one, rate: float, seconds: float) -> tuple[list[Sample], float]:
    """A request started every 1 / `rate` seconds for `seconds`, however long each takes; all awaited."""
    start = time.perf_counter()
    tasks = []
    for i in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
        tasks.append(asyncio.ensure_future(one()))
    samples = list(await asyncio.gather(*tasks))
    return samples, time.perf_counter() - start


def completions_request(client: StreamClient, max_tokens: int, keys: tuple[str, ...] = ()):
    """One streaming /v1/completions request; raises unless it streams `max_tokens` token chunks, usage and [DONE].
    With `keys`, the requests take turns sending each as their API key (--tenants)."""
    body = json.dumps({"model": "pdserve-tiny", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True}).encode()
    requests = itertools.cycle([client.request("/v1/completions", body, {"Authorization": f"Bearer {key}"})
                                for key in keys] or [client.request("/v1/completions", body)])

    async def one() -> Sample:
        start = time.perf_counter()
        status, body, first_read = await client.post(next(requests))
        e2e = time.perf_counter() - start
        if status != 200:
            raise RuntimeError(f"{client.host}:{client.port} answered {status}: {body[:500]!r}")
        events = [event for event in body.split(b"\n\n") if event.startswith(b"data: ")]
        done = bool(events) and events.pop() == b"data: [DONE]"
        final = json.loads(events.pop()[6:]) if events else {}
        if final.get("error"):
            raise RuntimeError(f"{client.host}:{client.port} failed mid-stream: {final['error']}")
        tokens = final.get("usage", {}).get("completion_tokens", 0)
        if not done or len(events) != max_tokens or tokens != max_tokens:
            raise RuntimeError(f"{client.host}:{client.port} came back short: {len(events)} token chunks, final "
                               f"{final}, [DONE] {'seen' if done else 'missing'}; {max_tokens} tokens asked for")
        return Sample(first_read - start, e2e)  # to the first body byte: the first token's chunk

    return one


def direct_request(client: WorkerClient, prefill: list[str], decode: list[str], prompt_len: int, max_tokens: int):
    """The coordinator pipeline's calls, made by the client itself: round robin, as the coordinator routes."""
    pairs = itertools.cycle(list(zip(prefill, decode)))
    prompt = list(range(1, prompt_len + 1))

    async def one() -> Sample:
        p, d = next(pairs)
        request = GenerationRequest(uuid.uuid4().hex, prompt, SamplingOptions(temperature=0.0), max_tokens)
        start = time.perf_counter()
        sampling = sampling_to_pb(request, max_tokens)
        call = client.open_decode(d, request, max_tokens, 4096, 60, sampling=sampling)
        accepted = await call.read()
        prefill_task = asyncio.create_task(client.prefill(
            p, request, max_tokens, d, 60, kv_data_address=accepted.kv_data_address,
            kv_transfer_token=accepted.kv_transfer_token, sampling=sampling,
            kv_layout_version=accepted.kv_layout_version, decode_cached_tokens=accepted.cached_tokens))
        ttft, tokens = None, 0
        while (event := await call.read()) is not None:
            if ttft is None:
                ttft = time.perf_counter() - start
            tokens += 1
            if event.finish_reason:  # the worker's pb.TokenEvent: set on the last token only
                break
        await prefill_task
        if tokens != max_tokens:
            raise RuntimeError(f"decode worker {d} came back short: {tokens} of {max_tokens} tokens")
        return Sample(ttft, time.perf_counter() - start)

    return one


def tls_link(cert_dir: Path, leaf: str) -> dict:
    """One link's mutual TLS, presenting `leaf`.pem (as launcher/cluster_security.py writes it)."""
    return {"tls_enable": True, "mutual_tls": True, "ca_cert": str(cert_dir / "ca.pem"),
            "tls_cert": str(cert_dir / f"{leaf}.pem"), "tls_key": str(cert_dir / f"{leaf}-key.pem")}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(path: Path, prefill: list[str], decode: list[str], cert_dir: Path | None = None,
                 manage_port: int = 0, algorithm: str = "round_robin", tenants: bool = False,
                 speculative: bool = False) -> Path:
    config = {
        # Kept-alive client connections wait while other paths' rows run: not closed under them meanwhile.
        "http_config": {"predict_ip": "127.0.0.1", "predict_port": 0, "manage_port": manage_port,
                        "keepalive_timeout_s": 600},
        "model_config": {"modelName": "pdserve-tiny"},
        "instances": {"prefill": [{"address": a} for a in prefill], "decode": [{"address": a} for a in decode]},
        "digs_scheduler_config": {"algorithm_type": algorithm},
    }
    if cert_dir is not None:  # serves clients with the server certificate, dials workers with the client one
        config["tls_config"] = {"predict": tls_link(cert_dir, "server"), "worker_grpc": tls_link(cert_dir, "client")}
    if tenants:  # every request names its tenant by its key; every limit on, none reached
        keys = path.with_name(path.stem + "-api-keys")
        keys.write_text("".join(f"{hash_key(key)} name=tenant-{i} weight={i + 1} rpm={10**9} tpm={10**9} "
                                f"concurrency={10**6}\n" for i, key in enumerate(TENANT_KEYS)))
        config["auth_config"] = {"api_keys_file": str(keys)}
    if speculative:
        config["speculative_config"] = {"enabled": True}
    path.write_text(json.dumps(config))
    return path


def sim_flags(args) -> tuple[str, ...]:
    """The simulated workers' flags (`pdserve worker` and bench/sim_fleet.py take the same): prefill 0 ms, one decode
    step of `--decode-step-ms` whatever the batch, no batch cap."""
    return ("--simulate", "--sim-prefill-base-ms", "0", "--sim-prefill-ms-per-token", "0", "--sim-decode-base-ms",
            str(args.decode_step_ms), "--sim-decode-ms-per-seq", "0", "--max-running", "4096",
            *(("--token-channel-port", "-1") if args.no_token_channel else ()))


@dataclass(frozen=True)
class Cores:
    pinned: set[int]  # the coordinator, the proxy, the direct client: the process whose CPU is measured
    others: set[int]  # the workers, the mock upstream, the HTTP clients
    share: float | None = None  # --cpu-share: each pinned process (not the direct client) held to this much of a core


@dataclass
class Cluster:
    """Simulated workers and a coordinator in front of them, plaintext or mutual TLS throughout."""

    suffix: str  # added to the path names of its rows
    workers: list[Process]
    prefill: list[str]
    decode: list[str]
    coordinator: Process | None = None
    against: Process | None = None  # with --against: the other coordinator, in front of the same workers
    client_ssl: ssl.SSLContext | None = None  # what its HTTP clients present to the predict port
    worker_tls: LinkTls | None = None  # what the direct baseline presents to the workers

    def stop(self) -> None:
        for process in (self.coordinator, self.against, *self.workers):
            if process is not None:
                process.stop()


def start_cluster(args, tmp: Path, cert_dir: Path | None, cores: Cores) -> Cluster:
    sim = (*sim_flags(args), "--metrics-port", "-1")
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
                                                         "pdserve worker ready:", cores.others), roles))
    cluster = Cluster(suffix, workers, [w.address for w in workers[: args.workers]],
                      [w.address for w in workers[args.workers:]])
    try:
        manage_port = free_port()  # its /metrics: the TTFT it measures itself, from arrival to the first token
        config = write_config(tmp / f"ms_coordinator{'-tls' if suffix else ''}.json", cluster.prefill, cluster.decode,
                              cert_dir, manage_port, args.algorithm, tenants=args.tenants,
                              speculative=args.speculative)
        cluster.coordinator = Process(pdserve("coordinator", "--config", str(config)), "pdserve coordinator ready:",
                                      cores.pinned, share=cores.share)
        cluster.coordinator.metrics_url = f"http://127.0.0.1:{manage_port}/metrics"
        if args.against and cert_dir is None:
            cluster.against = start_against(args.against, write_config(
                tmp / "ms_coordinator-against.json", cluster.prefill, cluster.decode, None, free_port(),
                args.against_algorithm), cores)
    except BaseException:
        cluster.stop()
        raise
    if cert_dir is not None:
        cluster.client_ssl = ssl.create_default_context(cafile=str(cert_dir / "ca.pem"))
        cluster.client_ssl.load_cert_chain(str(cert_dir / "client.pem"), str(cert_dir / "client-key.pem"))
        cluster.worker_tls = LinkTls("tls_config.worker_grpc", TlsLink(**tls_link(cert_dir, "client")), "client")
    return cluster


def start_against(against: str, config: Path, cores: Cores) -> Process:
    """The coordinator that --against names: this checkout's with NAME=VALUE in its environment, or another
    checkout's (a folder: `git worktree add /tmp/base HEAD~1`), run by this Python."""
    name, is_env, value = against.partition("=")
    where = {"env": {name: value}} if is_env else {"cwd": Path(against).resolve()}
    return Process(pdserve("coordinator", "--config", str(config)), "pdserve coordinator ready:", cores.pinned,
                   share=cores.share, **where)


def http_session(address: str, client_ssl: ssl.SSLContext | None = None) -> aiohttp.ClientSession:
    # No connection cap: 128 clients each keep their own connection alive.
    return aiohttp.ClientSession(address, connector=aiohttp.TCPConnector(limit=0, ssl=client_ssl or True),
                                 timeout=aiohttp.ClientTimeout(total=120))


def stream_client(stack: contextlib.ExitStack | contextlib.AsyncExitStack, address: str,
                  client_ssl: ssl.SSLContext | None = None) -> StreamClient:
    client = StreamClient(address, client_ssl)
    stack.callback(client.close)
    return client


async def server_ttft(metrics_url: str) -> tuple[float, float]:
    """The coordinator's own TTFT histogram (arrival to the first token in hand): its sum and count."""
    async with aiohttp.ClientSession() as session, session.get(metrics_url) as resp:
        text = await resp.text()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("pdserve_time_to_first_token_seconds_")}
    return values["pdserve_time_to_first_token_seconds_sum"], values["pdserve_time_to_first_token_seconds_count"]


async def measure_row(tokens: int, concurrency: int, name: str, one, client_cpus: set[int], pinned, args,
                      warmup_requests: int = 0, rate: float | None = None) -> Row:
    """A closed loop after a warm-up (of at least `warmup_requests`), and the pinned process's CPU over all of it."""
    pin_self(client_cpus)
    warm, _ = await closed_loop(one, concurrency, min(1.0, args.seconds))  # opens channels and connections
    while len(warm) < warmup_requests:
        warm += (await closed_loop(one, concurrency, 0.1))[0]
    metrics_url = getattr(pinned, "metrics_url", None)
    ttft0 = await server_ttft(metrics_url) if metrics_url else None
    cpu0 = pinned.cpu_seconds()
    if rate is not None:
        samples, elapsed = await open_loop(one, rate, args.seconds)
    else:
        # Staggered over one request's unloaded length, so that unloaded, requests end evenly spread in time.
        samples, elapsed = await closed_loop(one, concurrency, args.seconds, tokens * args.decode_step_ms / 1000)
    row = Row(tokens, concurrency, name, samples, elapsed, (pinned.cpu_seconds() - cpu0) / elapsed)
    if ttft0 is not None:
        (sum1, count1), (sum0, count0) = await server_ttft(metrics_url), ttft0
        row.server_ttft_ms = (sum1 - sum0) / max(count1 - count0, 1) * 1000
    print(f"{tokens} tokens c={concurrency} {name}: {row.rps:.0f} req/s, pinned CPU {row.cpu:.0%}, "
          f"{row.cpu_ms:.2f} ms/request", file=sys.stderr)
    return row


def median_row(rows: list[Row]) -> Row:
    """The round whose CPU per request is the median (the lower one of an even count)."""
    return sorted(rows, key=lambda row: row.cpu_ms)[(len(rows) - 1) // 2]


async def table_rows(args, proxy: Process, clusters: list[Cluster], cores: Cores) -> list[Row]:
    async with contextlib.AsyncExitStack() as stack:
        session = stream_client(stack, proxy.address)
        paths = {PASSTHROUGH: (lambda tokens, s=session: completions_request(s, tokens), cores.others, proxy)}
        keys = TENANT_KEYS if args.tenants else ()
        for cluster in clusters:
            session = stream_client(stack, cluster.coordinator.address, cluster.client_ssl)
            paths[THROUGH + cluster.suffix] = (lambda tokens, s=session: completions_request(s, tokens, keys),
                                               cores.others, cluster.coordinator)
            if cluster.against is not None:
                against = stream_client(stack, cluster.against.address)
                paths[AGAINST] = (lambda tokens, s=against: completions_request(s, tokens), cores.others,
                                  cluster.against)
            # The direct rows: at c=1 always (the TTFT the coordinator adds), at every level with --direct.
            async with http_session(cluster.coordinator.address, cluster.client_ssl) as once, once.post(
                    "/v1/completions", json={"model": "pdserve-tiny", "prompt": PROMPT, "max_tokens": 1},
                    headers={"Authorization": f"Bearer {keys[0]}"} if keys else None) as resp:
                prompt_len = (await resp.json())["usage"]["prompt_tokens"]
            client = WorkerClient(cluster.worker_tls)
            stack.push_async_callback(client.close)
            paths[BASELINE + cluster.suffix] = (
                lambda tokens, c=client, cl=cluster, n=prompt_len: direct_request(c, cl.prefill, cl.decode, n,
                                                                                   tokens),
                cores.pinned, ThisProcess())
        # With --repeats, the paths take turns round after round, so that each path's median row
        # comes from the same stretch of time as the others'.
        rounds = [[await measure_row(tokens, concurrency, name, make(tokens), client_cpus, pinned, args)
                   for tokens in args.max_tokens for concurrency in args.concurrency
                   for name, (make, client_cpus, pinned) in paths.items()
                   if args.direct or concurrency == 1 or not name.startswith(BASELINE)]
                  for _ in range(args.repeats)]
        return [median_row(same) for same in zip(*rounds)]


@dataclass
class FleetSetup:
    """One fleet size: its simulated instances and the coordinators measured in front of them, by path name."""

    size: int
    fleet: Process
    coordinators: dict[str, Process]


def start_fleets(args, tmp: Path, cores: Cores, running: contextlib.ExitStack) -> list[FleetSetup]:
    """Every size's fleet and coordinator(s), started at once so that rounds can take turns among them."""
    setups = []
    for size in args.fleet:
        fleet = Process(bench_script("sim_fleet.py", "--prefill", str(size // 2), "--decode", str(size // 2),
                                     *sim_flags(args)), "sim fleet ready:", cores.others)
        running.callback(fleet.stop)
        prefill, decode = (field.split("=", 1)[1].split(",") for field in fleet.ready_line.split()[-2:])
        config = write_config(tmp / f"ms_coordinator-fleet{size}.json", prefill, decode, algorithm=args.algorithm)
        coordinators = {THROUGH: Process(pdserve("coordinator", "--config", str(config)),
                                         "pdserve coordinator ready:", cores.pinned, share=cores.share)}
        running.callback(coordinators[THROUGH].stop)
        if args.against:
            coordinators[AGAINST] = start_against(args.against, write_config(
                tmp / f"ms_coordinator-fleet{size}-against.json", prefill, decode, None, free_port(),
                args.against_algorithm), cores)
            running.callback(coordinators[AGAINST].stop)
        setups.append(FleetSetup(size, fleet, coordinators))
    return setups


async def fleet_rows(args, setups: list[FleetSetup], cores: Cores) -> dict[tuple[int, str], Row]:
    """Each (size, path)'s median row over `--repeats` rounds, the sizes and paths taking turns in every round."""
    with contextlib.ExitStack() as stack:
        sessions = {(setup.size, name): stream_client(stack, coordinator.address)
                    for setup in setups for name, coordinator in setup.coordinators.items()}
        rounds: dict[tuple[int, str], list[Row]] = {key: [] for key in sessions}
        for _ in range(args.repeats):
            for setup in setups:
                for name, coordinator in setup.coordinators.items():
                    # Warm-up: `size` / 2 requests, round robin, have opened channels to every instance. At one
                    # offered rate for every size: a closed loop runs each at whatever rate its workers' core
                    # allows, and a less loaded coordinator pays more idle wake-ups per request, which would be
                    # compared instead of sizes.
                    concurrency = fleet_concurrency(args, setup.size)
                    rounds[setup.size, name].append(await measure_row(
                        FLEET_TOKENS, concurrency, f"{name}, {setup.size} instances",
                        completions_request(sessions[setup.size, name], FLEET_TOKENS), cores.others, coordinator,
                        args, warmup_requests=setup.size // 2,
                        rate=None if args.fleet_streams_per_decode else args.fleet_rate or None))
        return {key: median_row(rows) for key, rows in rounds.items()}


def fleet_concurrency(args, size: int) -> int:
    """A fleet row's clients: --fleet-streams-per-decode per decode instance, else the one fixed level."""
    return args.fleet_streams_per_decode * (size // 2) if args.fleet_streams_per_decode else FLEET_CONCURRENCY


def fleet_load(args) -> str:
    if args.fleet_streams_per_decode:
        return f"{args.fleet_streams_per_decode} streams per decode instance"
    return f"{args.fleet_rate:g} requests started per second" if args.fleet_rate else f"c={FLEET_CONCURRENCY}"


def even_size(text: str) -> int:
    size = int(text)
    if size < 2 or size % 2:
        raise argparse.ArgumentTypeError(f"a fleet is half prefill, half decode: {size} is not an even count >= 2")
    return size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[64, 256], help="streamed tokens per request")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured time per row")
    parser.add_argument("--workers", type=int, default=2, help="simulated prefill and decode workers, each")
    parser.add_argument("--decode-step-ms", type=float, default=1.0, help="the simulated decode step's cost")
    parser.add_argument("--direct", action="store_true", help="add the direct gRPC rows (no coordinator, no HTTP)")
    parser.add_argument("--no-token-channel", action="store_true", help="decode workers without a token channel: "
                        "every request a gRPC Decode call, every token a message (to measure what the channel buys)")
    parser.add_argument("--tls", action="store_true", help="add a mutual-TLS cluster's rows and TLS's cost")
    parser.add_argument("--plain-kv", action="store_true", help="with --tls (implied), the KV link (prefill -> "
                        "decode) in plaintext: TLS on the client and coordinator -> worker links only")
    parser.add_argument("--fleet-rate", type=float, default=40.0, help="with --fleet: requests started per second, "
                        "the same for every size (0: a closed loop of 32 clients instead)")
    parser.add_argument("--fleet", type=even_size, nargs="+", metavar="N", help="instead of the table: the "
                        f"coordinator's CPU per request at {FLEET_TOKENS} tokens c={FLEET_CONCURRENCY} in front of "
                        "N simulated instances (N/2 prefill, N/2 decode) for each N")
    parser.add_argument("--fleet-streams-per-decode", type=int, default=0, metavar="S", help="with --fleet: a closed "
                        "loop of S clients per decode instance at each size (the same load per worker) instead of "
                        "--fleet-rate")
    parser.add_argument("--algorithm", default="round_robin", choices=["round_robin", "load_balance", "cache_affinity"],
                        help="the coordinators' digs_scheduler_config.algorithm_type")
    parser.add_argument("--against-algorithm", default=None, choices=["round_robin", "load_balance", "cache_affinity"],
                        help="the --against coordinator's algorithm (default: --algorithm); `--against . "
                        "--against-algorithm cache_affinity` prices the KV index against round robin")
    parser.add_argument("--against", metavar="DIR|NAME=VALUE", help="a second coordinator in front of the same "
                        "workers, its rows beside this one's: another checkout's code (DIR), or this one's with NAME=VALUE "
                        "in its environment; to measure what one change buys")
    parser.add_argument("--cpu-share", type=float, metavar="F", help="hold the coordinator, the proxy and the --against "
                        "coordinator each to F of one core (a cgroup CPU quota; root): saturated, their CPU per request is "
                        "the cost at capacity, not also the idle wake-ups of a process its clients cannot keep busy")
    parser.add_argument("--tenants", action="store_true", help="the coordinator (not --against's) serves 4 "
                        "keys-file tenants with every limit on (none reached), the clients' requests taking turns "
                        "with the keys: tenancy's cost, against `--against` without it")
    parser.add_argument("--speculative", action="store_true", help="the coordinator (not --against's) keeps a "
                        "draft corpus (speculative_config.enabled) and sends every request the most hints: the "
                        "corpus's cost, against `--against` without it")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every row; each row's median (by CPU per "
                        "request) is shown")
    args = parser.parse_args()
    args.tls = args.tls or args.plain_kv
    args.against_algorithm = args.against_algorithm or args.algorithm

    cpus = sorted(os.sched_getaffinity(0))
    check_available(args.cpu_share)
    cores = Cores({cpus[0]}, set(cpus[1:]) or {cpus[0]}, args.cpu_share)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as running:
        if args.fleet:
            setups = start_fleets(args, Path(tmp), cores, running)
            rows = run_event_loop(fleet_rows(args, setups, cores))
            print_fleet(args, setups, rows, cores)
            return
        upstream = Process(bench_script("passthrough.py", "upstream", "--decode-step-ms", str(args.decode_step_ms)),
                           "passthrough upstream ready:", cores.others)
        running.callback(upstream.stop)
        proxy = Process(bench_script("passthrough.py", "proxy", "--upstream", upstream.address),
                        "passthrough proxy ready:", cores.pinned, share=cores.share)
        running.callback(proxy.stop)
        clusters = [start_cluster(args, Path(tmp), None, cores)]
        running.callback(clusters[0].stop)
        if args.tls:
            clusters.append(start_cluster(args, Path(tmp), ensure_local_certificates(Path(tmp) / "tls"), cores))
            running.callback(clusters[1].stop)
        rows = run_event_loop(table_rows(args, proxy, clusters, cores))  # the loop the coordinator runs on
    print_table(args, rows, cores)
    if args.tls:
        print_tls_costs(args, rows)


def print_table(args, rows: list[Row], cores: Cores) -> None:
    floor = {(r.tokens, r.concurrency): r for r in rows if r.path == PASSTHROUGH}
    print(f"\n{args.workers} simulated prefill + {args.workers} simulated decode workers (prefill 0 ms, decode step "
          f"{args.decode_step_ms:g} ms), a closed loop of {args.seconds:g} s per row. CPU {sorted(cores.pinned)}: the "
          f"pinned process (the proxy, the coordinator, or the direct client); CPU {sorted(cores.others)}: the "
          f"workers, the mock upstream and the HTTP clients. Latencies in ms; 'vs floor' and 'TTFT added' against the "
          f"pass-through at the same tokens and concurrency. Routing: coordinator {args.algorithm}"
          + (f", --against {args.against_algorithm}" if args.against else "") + "."
          + (f" Each pinned process but the direct client held to {args.cpu_share:g} of a core (--cpu-share)."
             if args.cpu_share else "") + "\n")
    print("| tokens | concurrency | path | requests/s | pinned CPU | CPU ms / request | vs floor | TTFT p50 | TTFT p99 "
          "| TTFT added | e2e p50 | e2e p99 |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        base = floor[r.tokens, r.concurrency]
        ttft = r.ttft_ms()
        vs_floor, added = ("-", "-") if r is base else (f"{r.cpu_ms / base.cpu_ms:.2f}x",
                                                        f"{ttft - base.ttft_ms():+.2f}")
        print(f"| {r.tokens} | {r.concurrency} | {r.path} | {r.rps:.0f} | {r.cpu:.0%} | {r.cpu_ms:.2f} | {vs_floor} "
              f"| {ttft:.2f} | {r.ttft_ms(0.99):.2f} | {added} | {r.e2e_ms():.1f} | {r.e2e_ms(0.99):.1f} |")
    print(f"\nrequests per row: {min(len(r.samples) for r in rows)} to {max(len(r.samples) for r in rows)}\n")
    through = {(r.tokens, r.concurrency): r for r in rows if r.path == THROUGH}
    against = {(r.tokens, r.concurrency): r for r in rows if r.path == AGAINST}
    for (tokens, concurrency), row in against.items():
        print(f"CPU/request at {tokens} tokens c={concurrency}, this checkout over --against {args.against}: "
              f"{through[tokens, concurrency].cpu_ms / row.cpu_ms:.2f}x")
    for tokens in args.max_tokens:
        if (tokens, 32) in through:
            ratio = through[tokens, 32].cpu_ms / floor[tokens, 32].cpu_ms
            print(f"CPU/request ratio at {tokens} tokens c=32: {ratio:.2f} (target <= {CPU_RATIO_TARGET:g}): "
                  f"{'met' if ratio <= CPU_RATIO_TARGET else 'MISSED'}")
    direct = {(r.tokens, r.concurrency): r for r in rows if r.path == BASELINE}
    for tokens in args.max_tokens:
        if (tokens, 1) in through and (tokens, 1) in direct:
            # Against the same worker calls made directly: the pass-through's upstream has no prefill or KV hop.
            # Inside: the coordinator's own clock (request arrival to the first token in hand) against the direct
            # client's, means; the HTTP hops to and from the client are what the pass-through row's TTFT shows.
            added = through[tokens, 1].ttft_ms() - direct[tokens, 1].ttft_ms()
            inside = through[tokens, 1].server_ttft_ms - direct[tokens, 1].mean_ttft_ms()
            print(f"TTFT added at c=1 ({tokens} tokens) over direct gRPC: {added:.2f} ms at the client (p50), "
                  f"{inside:.2f} ms inside the coordinator (mean; target < {TTFT_ADDED_TARGET_MS:g}): "
                  f"{'met' if inside < TTFT_ADDED_TARGET_MS else 'MISSED'}")


def print_tls_costs(args, rows: list[Row]) -> None:
    """Each path over mutual TLS against the same path in plaintext, same run."""
    kv = "KV in plaintext" if args.plain_kv else "KV over TCP"
    measured = {(r.tokens, r.concurrency, r.path): r for r in rows}
    print(f"\nMutual TLS vs plaintext, same run (clients -> predict port, coordinator -> workers' gRPC, {kv}):\n")
    print("| tokens | concurrency | path | requests/s, TLS | vs plaintext | pinned CPU ms / request, TLS "
          "| vs plaintext | TTFT p50, TLS | vs plaintext | e2e p50, TLS | vs plaintext |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for tokens in args.max_tokens:
        for concurrency in args.concurrency:
            for name in (THROUGH, BASELINE) if args.direct else (THROUGH,):
                plain = measured[tokens, concurrency, name]
                tls = measured[tokens, concurrency, name + TLS + (PLAIN_KV if args.plain_kv else "")]
                print(f"| {tokens} | {concurrency} | {name} | {tls.rps:.0f} | {tls.rps / plain.rps:.2f}x "
                      f"| {tls.cpu_ms:.2f} | {tls.cpu_ms / plain.cpu_ms:.2f}x "
                      f"| {tls.ttft_ms():.1f} | {tls.ttft_ms() / plain.ttft_ms():.2f}x "
                      f"| {tls.e2e_ms():.1f} | {tls.e2e_ms() / plain.e2e_ms():.2f}x |")


def print_fleet(args, setups: list[FleetSetup], rows: dict[tuple[int, str], Row], cores: Cores) -> None:
    smallest = min(setup.size for setup in setups)
    paths = list(setups[0].coordinators)
    print(f"\nThe coordinator (CPU {sorted(cores.pinned)}) in front of N simulated instances, N/2 prefill and N/2 "
          f"decode in one process (bench/sim_fleet.py, CPU {sorted(cores.others)}; prefill 0 ms, decode step "
          f"{args.decode_step_ms:g} ms), {FLEET_TOKENS} tokens, "
          f"{fleet_load(args)}, {args.algorithm} "
          f"for {args.seconds:g} s each"
          f"{f', median of {args.repeats} rounds (sizes taking turns)' if args.repeats > 1 else ''}"
          f"{f', each process held to {cores.share:g} of a core' if cores.share else ''}. Latencies in ms.\n")
    print(f"| instances | path | requests/s | coordinator CPU | CPU ms / request | vs {smallest} instances | TTFT p50 "
          "| e2e p50 | fleet process RSS, MiB |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for setup in setups:
        for name in paths:
            row, base = rows[setup.size, name], rows[smallest, name]
            print(f"| {setup.size} | {name} | {row.rps:.0f} | {row.cpu:.0%} | {row.cpu_ms:.2f} "
                  f"| {row.cpu_ms / base.cpu_ms:.2f}x | {row.ttft_ms():.2f} | {row.e2e_ms():.1f} "
                  f"| {setup.fleet.rss_mib():.0f} |")
    print()
    for setup in setups:
        if setup.size == smallest:
            continue
        for name in paths:
            target = f" (target <= {FLEET_RATIO_TARGET:g} up to 64 instances)" if setup.size <= 64 else " (no target)"
            print(f"{name} CPU/request, {setup.size} instances vs {smallest}: "
                  f"{rows[setup.size, name].cpu_ms / rows[smallest, name].cpu_ms:.2f}x{target}")


if __name__ == "__main__":
    main()
