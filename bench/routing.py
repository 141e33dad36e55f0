"""Coordinator routing policies on a fleet of simulated workers: how often a prompt's prefix is already cached
where it lands, what that does to TTFT, and how much KV moves, with ratios against round_robin measured in the
same run.

    .venv/bin/python bench/routing.py                       # every setup, both workloads (5-8 min on 2 cores)
    .venv/bin/python bench/routing.py --sessions 4 --turns 3 --requests 24 --setups round_robin,events  # smoke

The fleet: 4 prefill + 2 decode `pdserve worker --simulate` processes (no model; `--sim-args`, default
SIM_ARGS below, sets the cost model). A simulated worker's prefix cache is a real paged block pool and its cost
model charges only the prompt tokens it did not find there, so TTFT follows cache hits. Every (setup, workload)
gets a fresh fleet and coordinator(s): empty caches, counters from zero. Setups (rows):

- `round_robin`: this checkout, algorithm round_robin.
- `guess`: the previous release's cache_affinity, which remembered where it had sent each prefix; coordinator and
  workers run from `--baseline-repo` (cwd and PYTHONPATH there, so its own code is imported). Skipped when not
  given.
- `events`: this checkout, cache_affinity: routes on the workers' real cache contents (their KV events).
- `events x2`: the same, two coordinators with one static instance list; requests alternate between them (a
  session's consecutive turns always go to different coordinators), so each routes conversations it did not start.
- `single`: 1 prefill + 1 decode worker, cache_affinity: every prompt lands in one cache as large as the four
  prefill workers' together, the reference hit rate. Its TTFT is not comparable (a quarter of the prefill capacity).
- `events+tier`: `events` with a KV tier (`--kv-tier-gb`, TIER_GB) under each prefill worker's pool.
- `unbounded`: `events` with prefill pools 100x `--prefill-cache-tokens`: the hit rate no eviction lowers.

Each prefill worker's KV pool holds `--prefill-cache-tokens` (2,560: between two and three system prompts), so no
worker can keep every shared prompt: the regime where where a prompt lands decides whether it is found.

Workloads (the same seeded prompts for every setup; token counts are the embedded model's tokenizer's, which the
coordinator uses; each request carries a seed, so the simulated answers, and thus the later turns, match too):

- `multiturn`: `--sessions` (16) conversations of `--turns` (6) streamed /v1/completions, starting at Poisson
  arrivals (`--session-rate`, 4/s). Turn 1 is a 300-token session-specific text; each next prompt is the previous
  prompt + a 32-token answer + "\\nUser: " + a 40-token message + "\\nAssistant:", sent an exponential think time
  (mean 0.3 s) after the answer ended. 32 new tokens per turn. The answer in the history is text written by the bench,
  not the simulated worker's (synthetic ids whose text tokenizes to about 5.7 tokens each): what a real answer adds.
- `system-prompts`: `--requests` (192) streamed /v1/completions at Poisson arrivals (`--request-rate`, 12/s), each
  one of 4 shared 1,000-token system prompts (seeded choice) + "\\n\\nQuestion N: " + a distinct 30-token question
  + "\\nAnswer:". 16 new tokens per request.

- `burst`: BURST_REQUESTS (16) requests sharing a new 1,000-token prefix + a distinct 30-token question, all sent at
  once: the prompt tokens the prefill workers computed in all, against one whole prompt + 15 questions (expected
  entries send the burst to one worker, which computes the prefix once).

Every request: temperature 0, ignore_eos. Per (setup, workload): TTFT p50 / p90 at the client (the first streamed
token); prefill hit rate = sum of the prefill workers' prefix_hit_tokens / prefix_queried_tokens from their gRPC
Health at the end (decode the same: what a decode worker holds is not transferred); KV MB sent per request (the
prefill workers' `pdserve_kv_transfer_bytes_total{side="send"}`), beside the mean prompt tokens per request.
Acceptance checks, per workload: events' prefill hit rate >= 0.9 x single's; events' TTFT p50 <= 0.4 x
round_robin's; events x2's prefill hit rate within 5% of events'; multiturn: events+tier's hit rate >= 0.9 x
unbounded's and its TTFT p50 <= 0.5 x events'; burst: computed prompt tokens <= 1.25 x the ideal. Process logs go to `--log-dir` (printed).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402
import grpc  # noqa: E402

from bench.serving import Outcome, OutcomeFigures, PromptMaker, error_kind, git_describe, http_get, stream_request  # noqa: E402
from proto import worker_pb2 as pb  # noqa: E402
from proto import worker_pb2_grpc as pb_grpc  # noqa: E402

# A tier block loads at 1/30 of computing its 16 tokens (2.4 ms), the ratio measured on the real checkpoint
# (docs/benchmarks/kv-tier.md).
SIM_ARGS = ("--sim-prefill-ms-per-token 0.15 --sim-prefill-base-ms 2 --sim-decode-base-ms 5 "
            "--sim-tier-load-ms-per-block 0.08")
PREFILL_CACHE_TOKENS = 2560
TIER_GB = 0.05  # per prefill worker of `events+tier`: every session's blocks fit (the simulated KV is small)
SETUPS = ("round_robin", "guess", "events", "events x2", "single", "events+tier", "unbounded")
WORKLOADS = ("multiturn", "system-prompts", "burst")
BURST_REQUESTS, BURST_PREFIX_TOKENS = 16, 1000
MODEL_NAME = "pdserve-tiny"
MAX_SEQ_LEN = 2048  # the embedded model's max_position_embeddings caps prompts at this anyway
FIRST_TURN_TOKENS, FOLLOWUP_TOKENS, TURN_MAX_TOKENS, THINK_MEAN_S = 300, 40, 32, 0.3
SYSTEM_PROMPTS, SYSTEM_TOKENS, QUESTION_TOKENS, ANSWER_MAX_TOKENS = 4, 1000, 30, 16
STOP_GRACE_S = 15
START_TIMEOUT_S = 120
SHOW_ERRORS = 3


def log(msg: str) -> None:
    print(f"[routing {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------- processes


class Proc:
    """One pdserve process in its own process group, its output in a log file (never a pipe that could fill)."""

    def __init__(self, name: str, argv: list[str], repo: Path, log_path: Path):
        self.name, self.log_path = name, log_path
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # The repo's own code, not whatever checkout the venv's editable install points at.
        env["PYTHONPATH"] = os.pathsep.join([str(repo)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, cwd=repo, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def line_value(self, prefix: str, deadline: float) -> str:
        """The last word of the first output line starting with `prefix`, waiting for it until `deadline`."""
        while True:
            m = re.search(rf"^{re.escape(prefix)}.*?(\S+)\s*$", self.log_path.read_text(errors="replace"), re.M)
            if m:
                return m.group(1)
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-15:])
                state = f"exited with {self.proc.returncode}" if self.proc.poll() is not None else "timed out"
                raise RuntimeError(f"{self.name} {state} before `{prefix}`; log {self.log_path}:\n{tail}")
            time.sleep(0.2)

    def terminate(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the group this script started, by its id
        except ProcessLookupError:
            pass

    def reap(self, deadline: float) -> None:
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log(f"{self.name} still running {STOP_GRACE_S} s after SIGTERM: SIGKILL")
        try:  # the leader if it is still there, and any child that outlived it
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.log.close()


def stop_all(procs: list[Proc]) -> None:
    """SIGTERM to every process at once, then SIGKILL to whatever is left after STOP_GRACE_S."""
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        p.reap(deadline)


@dataclass(frozen=True)
class Setup:
    name: str
    repo: Path | None  # None: `guess` without --baseline-repo
    algorithm: str
    prefill: int = 4
    decode: int = 2
    coordinators: int = 1
    prefill_cache_scale: int = 1  # its prefill workers' caches, in multiples of --prefill-cache-tokens
    tier_gb: float = 0.0  # a KV tier of this size under each prefill worker's pool


@dataclass
class Worker:
    role: str
    proc: Proc
    address: str = ""
    metrics_url: str = ""


@dataclass
class Fleet:
    """Workers and coordinator(s) of one (setup, workload); every process it started is in `procs`."""

    workers: list[Worker] = field(default_factory=list)
    coordinators: list[str] = field(default_factory=list)  # their predict URLs
    procs: list[Proc] = field(default_factory=list)

    def stop(self) -> None:
        stop_all(self.procs)
        self.procs = []


def python_of(repo: Path) -> str:
    exe = repo / ".venv" / "bin" / "python"
    return str(exe) if exe.exists() else sys.executable


def coordinator_config(setup: Setup, workers: list[Worker]) -> dict:
    """As tests/helpers.py write_config: every worker listed statically, generous limits."""
    return {
        "http_config": {"predict_ip": "127.0.0.1", "predict_port": 0, "manage_port": 0},
        "model_config": {"modelName": MODEL_NAME, "maxSeqLen": MAX_SEQ_LEN, "maxInputTokenLen": MAX_SEQ_LEN,
                         "maxIterTimes": 512},
        "instances": {role: [{"address": w.address} for w in workers if w.role == role]
                      for role in ("prefill", "decode")},
        "digs_scheduler_config": {"algorithm_type": setup.algorithm},
        "request_limit": {"max_requests": 10000, "max_running": 1000},
        "exception_config": {"first_token_timeout": 120, "infer_timeout": 300},
    }


def start_fleet(setup: Setup, tag: str, sim_args: list[str], prefill_cache_tokens: int, log_dir: Path) -> Fleet:
    """Workers first (all at once), then the coordinator(s) naming them; each ready when it says so."""
    fleet = Fleet()
    python = python_of(setup.repo)
    slug = f"{setup.name.replace(' ', '')}-{tag}"
    try:
        for i, role in enumerate(["prefill"] * setup.prefill + ["decode"] * setup.decode):
            argv = [python, "-m", "launcher.cli", "worker", "--role", role, "--port", "0", "--simulate",
                    "--metrics-port", "0", *sim_args]
            if role == "prefill":  # a cache that cannot hold every prompt: where a prompt lands matters
                argv += ["--kv-budget-tokens", str(prefill_cache_tokens * setup.prefill_cache_scale)]
                if setup.tier_gb:
                    argv += ["--kv-tier-gb", str(setup.tier_gb)]
            proc = Proc(f"{setup.name} {role} {i}", argv, setup.repo, log_dir / f"{slug}-{role}{i}.log")
            fleet.procs.append(proc)
            fleet.workers.append(Worker(role, proc))
        deadline = time.monotonic() + START_TIMEOUT_S
        for w in fleet.workers:
            w.address = w.proc.line_value("pdserve worker ready:", deadline).split("=", 1)[-1]
            w.metrics_url = w.proc.line_value("pdserve worker metrics:", deadline)
        config = log_dir / f"{slug}-coordinator.json"
        config.write_text(json.dumps(coordinator_config(setup, fleet.workers)))
        coordinators = [Proc(f"{setup.name} coordinator {i}", [python, "-m", "launcher.cli", "coordinator",
                                                                 "--config", str(config)],
                             setup.repo, log_dir / f"{slug}-coordinator{i}.log") for i in range(setup.coordinators)]
        fleet.procs += coordinators
        for c in coordinators:
            fleet.coordinators.append(c.line_value("pdserve coordinator ready:", deadline).rstrip("/"))
        for url in fleet.coordinators:
            wait_healthy(url, deadline)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def wait_healthy(url: str, deadline: float) -> None:
    """/health answers 200 once a prefill and a decode instance are routable."""
    while True:
        try:
            if http_get(url + "/health")[0] == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health not 200 after {START_TIMEOUT_S} s")
        time.sleep(0.3)


# ----------------------------------------------------------------------------------------- worker figures


@dataclass
class CacheFigures:
    hit: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    queried: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    kv_sent_bytes: float = 0.0

    def computed(self, role: str) -> int:
        """Prompt tokens the role's workers computed (looked up and not found)."""
        return self.queried[role] - self.hit[role]

    def hit_rate(self, role: str) -> float | None:
        return self.hit[role] / self.queried[role] if self.queried[role] else None


def health(worker: Worker) -> pb.HealthResponse:
    """The worker's gRPC Health reply (old workers' too: the prefix counters are the same fields)."""
    stub = pb_grpc.PrefillServiceStub if worker.role == "prefill" else pb_grpc.DecodeServiceStub
    with grpc.insecure_channel(worker.address) as channel:
        return stub(channel).Health(pb.HealthRequest(), timeout=10)


def kv_sent(metrics_url: str) -> float:
    """The worker's `pdserve_kv_transfer_bytes_total{side="send"}`, summed over transports."""
    status, text = http_get(metrics_url.rstrip("/") + "/metrics", timeout=10)
    if status != 200:
        raise RuntimeError(f"{metrics_url}/metrics answered {status}")
    return sum(float(m.group(1)) for m in re.finditer(
        r'^pdserve_kv_transfer_bytes_total\{[^}]*side="send"[^}]*\}\s+(\S+)', text, re.M))


def cache_figures(fleet: Fleet) -> CacheFigures:
    """Counters since the workers started (a fresh fleet per workload, so: this workload's)."""
    figures = CacheFigures()
    for w in fleet.workers:
        reply = health(w)
        figures.hit[w.role] += reply.prefix_hit_tokens
        figures.queried[w.role] += reply.prefix_queried_tokens
        if w.role == "prefill":
            figures.kv_sent_bytes += kv_sent(w.metrics_url)
    return figures


# -------------------------------------------------------------------------------------------------- workloads


def poisson_arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    """Start offsets (s) of `n` arrivals at `rate` per second; the first at 0."""
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


@dataclass
class Session:
    start_s: float
    first_prompt: str
    answers: list[str]  # what each turn's answer adds to the history (see multiturn_plan)
    messages: list[str]  # turns 2..: the new user text, wrapped
    think_s: list[float]  # after each turn's answer
    seeds: list[int]


def multiturn_plan(args, prompts: PromptMaker) -> list[Session]:
    """Every session's text, arrival and think times, drawn before the clock starts (the same for every setup)."""
    rng = random.Random(args.seed * 1000 + 1)
    starts = poisson_arrivals(rng, args.sessions, args.session_rate)
    sessions = []
    for s in range(args.sessions):
        first = prompts.text(rng, FIRST_TURN_TOKENS, lead=f"Session {s}. My notes:")
        # A simulated worker's answer is synthetic token ids whose text does not tokenize back to 32 tokens (about 5.7
        # per id here), so the history carries a 32-token answer written here instead: what a real answer adds.
        answers = [" " + prompts.text(rng, TURN_MAX_TOKENS) for _ in range(args.turns)]
        messages = [f"\nUser: {prompts.text(rng, FOLLOWUP_TOKENS)}\nAssistant:" for _ in range(args.turns - 1)]
        think = [rng.expovariate(1 / THINK_MEAN_S) for _ in range(args.turns)]
        sessions.append(Session(starts[s], first, answers, messages, think,
                                [args.seed * 1_000_000 + s * 1000 + t + 1 for t in range(args.turns)]))
    return sessions


def system_prompts_plan(args, prompts: PromptMaker) -> list[tuple[float, str, int]]:
    """(arrival offset, prompt, seed) of every request."""
    rng = random.Random(args.seed * 1000 + 2)
    systems = [prompts.text(rng, SYSTEM_TOKENS, lead=f"You are assistant {k}. Follow these rules.")
               for k in range(SYSTEM_PROMPTS)]
    starts = poisson_arrivals(rng, args.requests, args.request_rate)
    return [(starts[i], f"{rng.choice(systems)}\n\nQuestion {i}: {prompts.text(rng, QUESTION_TOKENS)}\nAnswer:",
             args.seed * 1_000_000 + i + 1) for i in range(args.requests)]


def burst_plan(args, prompts: PromptMaker) -> list[tuple[float, str, int]]:
    """BURST_REQUESTS prompts sharing one new BURST_PREFIX_TOKENS-token prefix, all sent at once."""
    rng = random.Random(args.seed * 1000 + 3)
    prefix = prompts.text(rng, BURST_PREFIX_TOKENS, lead="A new document, read it.")
    return [(0.0, f"{prefix}\n\nQuestion {i}: {prompts.text(rng, QUESTION_TOKENS)}\nAnswer:",
             args.seed * 1_000_000 + i + 1) for i in range(BURST_REQUESTS)]


def body(prompt: str, max_tokens: int, seed: int) -> dict:
    # The seed makes the simulated answer a function of the request alone: later turns match across setups.
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "seed": seed,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def sleep_until(t0: float, offset_s: float) -> None:
    await asyncio.sleep(max(0.0, t0 + offset_s - time.monotonic()))


async def run_multiturn(http: aiohttp.ClientSession, urls: list[str], sessions: list[Session]) -> list[Outcome]:
    """Every session's turns in order, each prompt the last one grown by its answer and the next message."""
    t0 = time.monotonic()

    async def conversation(s: int, session: Session) -> list[Outcome]:
        await sleep_until(t0, session.start_s)
        outcomes, prompt = [], session.first_prompt
        for t in range(len(session.seeds)):
            # (s + t) % n: a session's next turn always goes to the other coordinator, never the one it started on
            url = urls[(s + t) % len(urls)] + "/v1/completions"
            outcome = await stream_request(http, url, body(prompt, TURN_MAX_TOKENS, session.seeds[t]))
            outcomes.append(outcome)
            if t + 1 < len(session.seeds):
                prompt = prompt + session.answers[t] + session.messages[t]
                await asyncio.sleep(session.think_s[t])
        return outcomes

    results = await asyncio.gather(*(conversation(s, x) for s, x in enumerate(sessions)))
    return [o for conv in results for o in conv]


async def run_system_prompts(http: aiohttp.ClientSession, urls: list[str],
                             requests: list[tuple[float, str, int]]) -> list[Outcome]:
    """Every request at its arrival time, however long the earlier ones take (an open loop)."""
    t0 = time.monotonic()

    async def one(i: int, start_s: float, prompt: str, seed: int) -> Outcome:
        await sleep_until(t0, start_s)
        return await stream_request(http, urls[i % len(urls)] + "/v1/completions",
                                    body(prompt, ANSWER_MAX_TOKENS, seed))

    return list(await asyncio.gather(*(one(i, *r) for i, r in enumerate(requests))))


async def drive(workload: str, plan, urls: list[str]) -> list[Outcome]:
    connector = aiohttp.TCPConnector(limit=0)  # no client-side cap: arrivals are the load
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as http:
        if workload == "multiturn":
            return await run_multiturn(http, urls, plan)
        return await run_system_prompts(http, urls, plan)  # the burst too: its arrivals are all at 0


# ---------------------------------------------------------------------------------------------------- results


@dataclass
class Result(OutcomeFigures):
    setup: str
    workload: str
    outcomes: list[Outcome] = field(default_factory=list)
    cache: CacheFigures | None = None
    wall_s: float = 0.0
    skipped: str = ""

    def hit_rate(self, role: str) -> float | None:
        return self.cache.hit_rate(role) if self.cache else None

    @property
    def kv_mb_per_request(self) -> float | None:
        return self.cache.kv_sent_bytes / len(self.outcomes) / 1e6 if self.cache and self.outcomes else None


def measure(setup: Setup, workload: str, plan, args, log_dir: Path) -> Result:
    """A fresh fleet for one workload; its figures; the fleet stopped whatever happens."""
    log(f"setup {setup.name}: starting fleet for {workload}")
    fleet = start_fleet(setup, workload, shlex.split(args.sim_args), args.prefill_cache_tokens, log_dir)
    try:
        log(f"setup {setup.name}: {workload} against {', '.join(fleet.coordinators)}")
        t0 = time.monotonic()
        outcomes = asyncio.run(drive(workload, plan, fleet.coordinators))
        result = Result(setup.name, workload, outcomes, wall_s=time.monotonic() - t0)
        result.cache = cache_figures(fleet)
    finally:
        log(f"setup {setup.name}: stopping fleet")
        fleet.stop()
    log(f"setup {setup.name} {workload}: {len(result.ok)}/{len(outcomes)} ok in {result.wall_s:.1f} s, "
        f"TTFT p50 {fmt(result.ttft(0.5), '.3f')} s, prefill hit {fmt(result.hit_rate('prefill'), '.2f')}")
    return result


def fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def ratio(value: float | None, base: float | None) -> str:
    return "–" if value is None or not base else f"{value / base:.2f}x"


def table(workload: str, title: str, results: dict[str, Result]) -> str:
    """One workload's markdown table, a row per setup, and the failures counted by kind below it."""
    rr, single = results.get("round_robin"), results.get("single")
    head = ("| setup | requests ok | TTFT p50 (s) | p50 vs round_robin | TTFT p90 (s) | prefill hit rate | "
            "vs single | decode hit rate | KV MB / request | prompt tokens / request |")
    lines = [f"### {workload}: {title}", "", head, "|" + "---|" * head.count(" | ") + "---|"]
    notes = []
    for name, r in results.items():
        if r.skipped:
            lines.append(f"| {name} | skipped: {r.skipped} |" + " – |" * 8)
            continue
        mark = " (not comparable)" if name == "single" else ""
        rr_p50 = rr.ttft(0.5) if rr and not rr.skipped else None
        single_hit = single.hit_rate("prefill") if single and not single.skipped else None
        lines.append(
            f"| {name} | {len(r.ok)}/{len(r.outcomes)} | {fmt(r.ttft(0.5), '.3f')}{mark} | "
            f"{ratio(r.ttft(0.5), rr_p50) if not mark else '–'} | {fmt(r.ttft(0.9), '.3f')}{mark} | "
            f"{fmt(r.hit_rate('prefill'), '.3f')} | {ratio(r.hit_rate('prefill'), single_hit)} | "
            f"{fmt(r.hit_rate('decode'), '.3f')} | {fmt(r.kv_mb_per_request, '.3f')} | "
            f"{fmt(r.prompt_tokens, '.0f')} |")
        errors = [o.error for o in r.outcomes if not o.ok]
        if errors:
            kinds = collections.Counter(error_kind(e) for e in errors)
            notes.append(f"- {name}: {len(errors)} failed: " + "; ".join(
                f"{n} x `{k[:300]}`" for k, n in kinds.most_common(SHOW_ERRORS)))
    return "\n".join(lines + (["", "Errors:"] + notes if notes else []))


def checks(workload: str, results: dict[str, Result]) -> list[str]:
    """The acceptance checks; n/a where a row they need was not run."""
    def get(name, fn):
        r = results.get(name)
        return fn(r) if r is not None and not r.skipped else None

    def verdict(ok, *values):
        return "n/a" if any(v is None for v in values) else ("PASS" if ok() else "FAIL")

    if workload == "burst":  # every prefix computed once: one whole prompt and the other requests' tails
        out = []
        for name, r in results.items():
            if r.skipped or not r.cache or not r.outcomes:
                continue
            prompt = r.prompt_tokens
            ideal = prompt + (len(r.outcomes) - 1) * (prompt - BURST_PREFIX_TOKENS) if prompt else None
            computed = r.cache.computed("prefill")
            out.append(f"- burst {name}: prompt tokens computed {computed} = {ratio(computed, ideal)} one prompt "
                       f"+ {len(r.outcomes) - 1} tails ({fmt(ideal, '.0f')}); <= 1.25x: "
                       + verdict(lambda: computed <= 1.25 * ideal, ideal))
        return out
    if workload == "multiturn" and ("events+tier" in results or "unbounded" in results):
        tier_hit, unb_hit, ev_p50 = get("events+tier", lambda r: r.hit_rate("prefill")), get(
            "unbounded", lambda r: r.hit_rate("prefill")), get("events", lambda r: r.ttft(0.5))
        tier_p50 = get("events+tier", lambda r: r.ttft(0.5))
        tier_lines = [
            f"- multiturn (4) events+tier prefill hit rate {fmt(tier_hit, '.3f')} >= 0.9 x unbounded's "
            f"{fmt(unb_hit, '.3f')}: " + verdict(lambda: tier_hit >= 0.9 * unb_hit, tier_hit, unb_hit),
            f"- multiturn (5) events+tier TTFT p50 {fmt(tier_p50, '.3f')} s <= 0.5 x events' (no tier) "
            f"{fmt(ev_p50, '.3f')} s: " + verdict(lambda: tier_p50 <= 0.5 * ev_p50, tier_p50, ev_p50)]
    else:
        tier_lines = []

    hit = lambda r: r.hit_rate("prefill")  # noqa: E731
    p50 = lambda r: r.ttft(0.5)  # noqa: E731
    ev_hit, single_hit, x2_hit = get("events", hit), get("single", hit), get("events x2", hit)
    ev_p50, rr_p50 = get("events", p50), get("round_robin", p50)
    return tier_lines + [
        f"- {workload} (1) events prefill hit rate {fmt(ev_hit, '.3f')} >= 0.9 x single's {fmt(single_hit, '.3f')}: "
        + verdict(lambda: ev_hit >= 0.9 * single_hit, ev_hit, single_hit),
        f"- {workload} (2) events TTFT p50 {fmt(ev_p50, '.3f')} s <= 0.4 x round_robin's {fmt(rr_p50, '.3f')} s: "
        + verdict(lambda: ev_p50 <= 0.4 * rr_p50, ev_p50, rr_p50),
        f"- {workload} (3) events x2 prefill hit rate {fmt(x2_hit, '.3f')} within 5% of events' "
        f"{fmt(ev_hit, '.3f')}: " + verdict(lambda: abs(x2_hit - ev_hit) <= 0.05 * ev_hit, x2_hit, ev_hit),
    ]


# ------------------------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    csv = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    p.add_argument("--workloads", type=csv, default=list(WORKLOADS), help=f"comma-separated, of {','.join(WORKLOADS)}")
    p.add_argument("--setups", type=csv, default=list(SETUPS), help=f"comma-separated, of {','.join(SETUPS)}")
    p.add_argument("--sessions", type=int, default=16, help="multiturn conversations (default 16)")
    p.add_argument("--turns", type=int, default=6, help="turns per conversation (default 6)")
    p.add_argument("--requests", type=int, default=192, help="system-prompts requests (default 192)")
    p.add_argument("--session-rate", type=float, default=4.0, help="multiturn session arrivals per second (4)")
    p.add_argument("--request-rate", type=float, default=12.0, help="system-prompts arrivals per second (12)")
    p.add_argument("--sim-args", default=SIM_ARGS,
                   help=f"cost-model flags of every worker, as --sim-args='...' (default '{SIM_ARGS}')")
    p.add_argument("--prefill-cache-tokens", type=int, default=PREFILL_CACHE_TOKENS,
                   help=f"each prefill worker's KV pool, in tokens (default {PREFILL_CACHE_TOKENS}: between two and three "
                   "system prompts; `single`'s one prefill worker gets 4x, the fleet's total)")
    p.add_argument("--baseline-repo", type=Path, default=None,
                   help="checkout of the previous release, for the `guess` row, e.g. made by `git worktree add "
                        "../guess <tag>` (without it the row is skipped)")
    p.add_argument("--seed", type=int, default=1, help="seed of the prompts, arrivals and answers (default 1)")
    p.add_argument("--log-dir", type=Path, default=None, help="process logs (default: a temp folder, printed)")
    args = p.parse_args(argv)
    for name, chosen, allowed in (("--workloads", args.workloads, WORKLOADS), ("--setups", args.setups, SETUPS)):
        if not chosen or set(chosen) - set(allowed):
            p.error(f"{name}: choose from {','.join(allowed)}")
    if min(args.sessions, args.turns, args.requests) < 1 or min(args.session_rate, args.request_rate) <= 0:
        p.error("--sessions, --turns, --requests and the rates must be positive")
    return args


def make_setups(names: list[str], baseline: Path | None) -> list[Setup]:
    """The chosen rows, in the table's order whatever order --setups named them in."""
    known = {"round_robin": Setup("round_robin", REPO, "round_robin"),
              "guess": Setup("guess", baseline.resolve() if baseline else None, "cache_affinity"),
              "events": Setup("events", REPO, "cache_affinity"),
              "events x2": Setup("events x2", REPO, "cache_affinity", coordinators=2),
              "single": Setup("single", REPO, "cache_affinity", prefill=1, decode=1, prefill_cache_scale=4),
              "events+tier": Setup("events+tier", REPO, "cache_affinity", tier_gb=TIER_GB),
              "unbounded": Setup("unbounded", REPO, "cache_affinity", prefill_cache_scale=100)}
    return [known[n] for n in SETUPS if n in names]  # always in the table's order


def titles(args) -> dict[str, str]:
    """Each workload's one-line description, for its table's heading."""
    return {
        "multiturn": f"{args.sessions} sessions x {args.turns} turns, Poisson session arrivals at "
                     f"{args.session_rate:g}/s, think time exp(mean {THINK_MEAN_S} s), first turn "
                     f"{FIRST_TURN_TOKENS} tokens then +answer +{FOLLOWUP_TOKENS} tokens, {TURN_MAX_TOKENS} new "
                     f"tokens per turn",
        "system-prompts": f"{args.requests} requests, Poisson arrivals at {args.request_rate:g}/s, one of "
                          f"{SYSTEM_PROMPTS} shared {SYSTEM_TOKENS}-token system prompts + a {QUESTION_TOKENS}-token "
                          f"question, {ANSWER_MAX_TOKENS} new tokens",
        "burst": f"{BURST_REQUESTS} requests sharing a new {BURST_PREFIX_TOKENS}-token prefix + a "
                 f"{QUESTION_TOKENS}-token question, all sent at once, {ANSWER_MAX_TOKENS} new tokens",
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the `finally`s stop the fleet on SIGTERM too
    command = shlex.join(["bench/routing.py"] + (sys.argv[1:] if argv is None else argv))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-routing-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log(f"process logs in {log_dir}")
    setups = make_setups(args.setups, args.baseline_repo)

    from embedded_model.builder import ensure_default_model
    prompts = PromptMaker(str(ensure_default_model()))
    plans = {"multiturn": multiturn_plan, "system-prompts": system_prompts_plan, "burst": burst_plan}
    plans = {w: plans[w](args, prompts) for w in WORKLOADS if w in args.workloads}

    results: dict[str, dict[str, Result]] = {w: {} for w in plans}
    for setup in setups:
        if setup.name == "guess" and (setup.repo is None or not setup.repo.is_dir()):
            reason = "no --baseline-repo" if setup.repo is None else f"no {setup.repo}"
            log(f"setup guess: {reason}; skipped")
            for w in plans:
                results[w][setup.name] = Result(setup.name, w, skipped=reason)
            continue
        for workload, plan in plans.items():
            try:
                results[workload][setup.name] = measure(setup, workload, plan, args, log_dir)
            except RuntimeError as exc:  # a process that did not start: the row says so, the others still run
                log(str(exc))
                results[workload][setup.name] = Result(setup.name, workload, skipped=str(exc).splitlines()[0])

    baseline = (f"`{args.baseline_repo}` at {git_describe(args.baseline_repo)}"
                if args.baseline_repo and args.baseline_repo.is_dir()
                else f"`{args.baseline_repo}`: absent, `guess` skipped" if args.baseline_repo
                else "none given, `guess` skipped")
    out = [f"## bench/routing.py, {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs", "",
           f"Command: `{command}`", "",
           f"This repo: `{REPO}` at {git_describe(REPO)}. Baseline (`guess`): {baseline}.", "",
           f"Workers: `pdserve worker --simulate {args.sim_args}`; 4 prefill + 2 decode (`single`: 1 + 1), a fresh "
           f"fleet per (setup, workload). Hit rates: prefix_hit_tokens / prefix_queried_tokens summed over the "
           f"role's workers. TTFT at the client. Ratios against rows of this run. Process logs: `{log_dir}`."]
    workload_titles = titles(args)
    for w in plans:
        out += ["", table(w, workload_titles[w], results[w])]
    out += ["", "Acceptance checks:"] + [line for w in plans for line in checks(w, results[w])]
    print("\n".join(out), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the fleet was stopped on the way out
        log("interrupted")
        sys.exit(130)
