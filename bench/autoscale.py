"""A workload that shifts, on `pdserve up` clusters: `--autoscale` against a static split sized for the first
phase, measured one after the other on the same seeded requests.

    .venv/bin/python bench/autoscale.py                          # simulated workers, 2 x (2 + 2) min: about 10 min
    .venv/bin/python bench/autoscale.py --phase-s 30 --rate 1    # smoke
    .venv/bin/python bench/autoscale.py --model DIR --workers 3 --initial 2:1 ...   # a real checkpoint

Phase 1 (`--phase-s`): long prompts, short answers; phase 2: short prompts, long answers; Poisson arrivals at
`--rate`. Prompts are token ids (distinct per request: no prefix cache hits), streamed /v1/completions with
ignore_eos, temperature 0. Per cluster and phase: requests, failed, SLO attainment (TTFT and TPOT at the client,
each request within both targets), TTFT and TPOT p50/p90, output tokens/s. For --autoscale also: each second's
split (the coordinator's `pdserve_planner_current_instances`), the seconds from each shift to the first change
toward the phase's recommendation, and the switches per worker per phase (`pdserve_instance_healthy`'s roles).

Each phase's recommendation is `pdserve plan`'s search (planner/online.py's shapes within --workers) on the phase's
synthetic workload; on simulated workers it is given their cost model exactly (the `--sim-*` flags), on a real
checkpoint it is left out (the planner's live fit is the only profile).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402

from bench.serving import git_describe  # noqa: E402

SIM = {"prefill_base_ms": 2.0, "prefill_ms_per_token": 2.0, "decode_base_ms": 20.0, "decode_ms_per_seq": 8.0}


@dataclass
class Result:
    phase: int
    ok: bool
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    tokens: int = 0
    error: str = ""


@dataclass(frozen=True)
class Phase:
    prompt: int
    output: int


async def one(session: aiohttp.ClientSession, url: str, phase: int, prompt: list[int], output: int,
              model: str) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    first = last = None
    count = 0
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return Result(phase, False, error=f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                event = json.loads(line[5:])
                if event.get("error"):
                    return Result(phase, False, error=str(event["error"])[:200])
                for choice in event.get("choices") or ():
                    if choice.get("text") is not None or choice.get("finish_reason"):
                        now = time.monotonic()
                        first = first or now
                        last = now
                if event.get("usage"):
                    count = event["usage"]["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Result(phase, False, error=f"{type(exc).__name__}: {exc}"[:200])
    if first is None or count == 0:
        return Result(phase, False, error="no tokens")
    return Result(phase, True, first - t0, (last - first) / max(1, count - 1), count)


def plan_requests(args, phases: list[Phase]) -> list[tuple[float, int, list[int], int]]:
    rng = random.Random(args.seed)
    out, t = [], 0.0
    for number, phase in enumerate(phases, 1):
        end = number * args.phase_s
        while True:
            t += rng.expovariate(args.rate)
            if t >= end:
                break
            out.append((t, number, [rng.randrange(200, 900) for _ in range(phase.prompt)], phase.output))
        t = end
    return out


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    values = {}
    for line in text.splitlines():
        m = re.match(r'(pdserve_planner_current_instances|pdserve_instance_healthy)\{([^}]*)\} ([0-9.e+-]+)', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            values[(m.group(1), labels.get("role"), labels.get("address"))] = float(m.group(3))
        m = re.match(r'(pdserve_request_rebalances_total|pdserve_request_migrations_total) ([0-9.e+-]+)', line)
        if m:
            values[(m.group(1), None, None)] = float(m.group(2))
    return values


async def watch(management: str, t0: float, timeline: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            values = await asyncio.to_thread(scrape, management)
            split = (int(values.get(("pdserve_planner_current_instances", "prefill", None), 0)),
                     int(values.get(("pdserve_planner_current_instances", "decode", None), 0)))
            roles = {addr: role for (name, role, addr), v in values.items() if name == "pdserve_instance_healthy"}
            moved = tuple(int(values.get((f"pdserve_request_{kind}_total", None, None), 0))
                          for kind in ("rebalances", "migrations"))
            timeline.append((time.monotonic() - t0, split, roles, moved))
        except OSError:
            pass
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


def worker_flags(args) -> str:
    return "--max-running 256" + ("" if args.model else " --simulate " + " ".join(
        f"--sim-{k.replace('_', '-')} {v}" for k, v in SIM.items()))


def profile_workers(args, log_dir: Path) -> dict[str, str]:
    """`pdserve profile` of one worker per role, started with the clusters' worker flags: the planner's seed."""
    files = {}
    if not args.profile:
        return files
    for role in ("prefill", "decode"):
        argv = [sys.executable, "-m", "launcher.cli", "worker", "--role", role, "--port", "0",
                *(["--model", args.model] if args.model else []), *worker_flags(args).split()]
        worker = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            address = next(line for line in worker.stdout if line.startswith("pdserve worker ready:")).split("=")[-1]
            files[f"{role}_profile"] = str(log_dir / f"{role}-profile.json")
            subprocess.run([sys.executable, "-m", "launcher.cli", "profile", "--worker", address.strip(), "--role",
                            role, "--out", files[f"{role}_profile"], "--batch-sizes", "1,4,16,32",
                            "--context-tokens", "64,256", "--prompt-tokens", "64,256,1024"],
                           cwd=REPO, check=True, capture_output=True)
        finally:
            worker.terminate()
            worker.wait()
    return files


def start_cluster(args, autoscale: bool, log_dir: Path, tag: str, profiles: dict) -> tuple[subprocess.Popen, str, str]:
    prefill, decode = (int(x) for x in args.initial.split(":"))
    config = {"planner_config": {**profiles, "ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms,
                                 "percentile": args.percentile,
                                 "interval_s": args.interval_s, "window_s": args.window_s,
                                 "min_requests": 10, "confirmations": 2, "cooldown_s": args.cooldown_s,
                                 "min_per_role": args.min_per_role},
              "model_config": {"maxSeqLen": 2048, "maxInputTokenLen": 2048, "maxIterTimes": 2047},
              "request_limit": {"max_running": 1000},
              "digs_scheduler_config": {"algorithm_type": "load_balance"},
              "http_config": {"predict_ip": "127.0.0.1", "predict_port": 0, "manage_port": 0}}
    config_path = log_dir / f"{tag}.json"
    config_path.write_text(json.dumps(config))
    worker_args = worker_flags(args)
    argv = [sys.executable, "-m", "launcher.cli", *(["--log-level", "info"] if os.environ.get("BENCH_VERBOSE") else []), "up", "--config", str(config_path), "--predict-port", "0",
            "--prefill", str(prefill), "--decode", str(decode), f"--worker-args={worker_args}"]
    if args.model:
        argv += ["--model", args.model]
    if autoscale:
        argv += ["--autoscale", "--max-workers", str(args.workers)]
    log = open(log_dir / f"{tag}.log", "w", buffering=1)
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True)
    management = ""
    for line in proc.stdout:
        log.write(line)
        if line.startswith("pdserve coordinator management:"):
            management = line.split()[-1]
        if line.startswith("pdserve ready:"):
            url = line.split()[-1]
            break
    else:
        raise RuntimeError(f"pdserve up exited: see {log_dir / (tag + '.log')}")

    def drain():
        for line in proc.stdout:
            log.write(line)
    threading.Thread(target=drain, daemon=True).start()
    return proc, url, management


async def drive(args, url: str, requests) -> list[Result]:
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.timeout_s),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:  # no client-side queue
        async with session.get(url + "/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]

        async def at(offset, phase, prompt, output):
            await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
            return await one(session, url, phase, prompt, output, model)
        return await asyncio.gather(*(at(*r) for r in requests))


def run(args, autoscale: bool, requests, log_dir: Path, profiles: dict) -> tuple[list[Result], list]:
    tag = "autoscale" if autoscale else "static"
    print(f"[{time.strftime('%H:%M:%S')}] {tag}: starting pdserve up", file=sys.stderr, flush=True)
    proc, url, management = start_cluster(args, autoscale, log_dir, tag, profiles)
    timeline: list = []
    try:
        async def both():
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(management, time.monotonic(), timeline, stop))
            results = await drive(args, url, requests)
            stop.set()
            await watcher
            return results
        results = asyncio.run(both())
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return results, timeline


def recommendation(args, phase: Phase) -> tuple[int, int] | None:
    if args.model:
        return None
    from planner.live import Attainment, Snapshot
    from planner.online import decide
    from planner.profile import DecodePoint, PrefillPoint
    from planner.settings import PlannerConfig
    from planner.simulation import WorkerSettings
    from planner.workload import TraceRequest, Workload

    config = PlannerConfig(enabled=True, ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms, percentile=args.percentile,
                           window_s=max(5.0, args.phase_s), min_requests=1, max_instances=args.workers,
                           min_per_role=args.min_per_role)
    rng = random.Random(args.seed)
    t, requests = 0.0, []
    for _ in range(max(1, int(args.phase_s * args.rate))):
        requests.append(TraceRequest(arrival_s=round(t, 6), prompt_tokens=phase.prompt, output_tokens=phase.output))
        t += rng.expovariate(args.rate)
    # The simulated workers' cost model, exactly: prefill base + per token; decode base + per sequence.
    prefill = tuple(PrefillPoint(prompt_tokens=n, handoff_ms=0.5, kv_bytes=n * 512,
                                 prefill_ms=SIM["prefill_base_ms"] + SIM["prefill_ms_per_token"] * n)
                    for n in (64, 512, 2048))
    decode = tuple(DecodePoint(batch_size=b, context_tokens=b * 100,
                               step_ms=SIM["decode_base_ms"] + SIM["decode_ms_per_seq"] * b) for b in (1, 8, 64))
    snapshot = Snapshot(Workload(requests=requests, span_s=args.phase_s), Attainment(1, 1, 1, len(requests)),
                        len(requests), prefill, decode)
    return decide(config, snapshot, WorkerSettings(max_running=256), 0, (0, 0)).counts


def summarise(results: list[Result], phase: int, args) -> dict:
    mine = [r for r in results if r.phase == phase]
    ok = [r for r in mine if r.ok]
    ttft = np.array([r.ttft_s * 1000 for r in ok]) if ok else np.array([np.nan])
    tpot = np.array([r.tpot_s * 1000 for r in ok]) if ok else np.array([np.nan])
    good = sum(r.ttft_s * 1000 <= args.ttft_ms and r.tpot_s * 1000 <= args.tpot_ms for r in ok)
    return {"requests": len(mine), "failed": len(mine) - len(ok), "attainment": good / len(mine) if mine else 0,
            "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p90": float(np.percentile(ttft, 90)),
            "tpot_p50": float(np.percentile(tpot, 50)), "tpot_p90": float(np.percentile(tpot, 90)),
            "tok_s": sum(r.tokens for r in ok) / args.phase_s,
            "errors": sorted({r.error for r in mine if not r.ok})[:3]}


def moves(timeline, args, phases_rec) -> list[str]:
    """Per phase: seconds from its start to the first split change toward its recommendation; switches per worker;
    streams moved by rebalancing and by migration."""
    out = []
    for number, rec in enumerate(phases_rec, 1):
        start, end = (number - 1) * args.phase_s, number * args.phase_s
        inside = [entry for entry in timeline if start <= entry[0] < end]
        if not inside:
            continue
        before = [split for t, split, _, _ in timeline if t < start]
        moved_before = [moved for t, _, _, moved in timeline if t < start]
        moved = [after - earlier for after, earlier in zip(inside[-1][3], moved_before[-1] if moved_before else (0, 0))]
        first_split = before[-1] if before else tuple(int(x) for x in args.initial.split(":"))
        toward = None
        if rec is not None:
            distance = abs(first_split[0] - rec[0]) + abs(first_split[1] - rec[1])
            for t, split, _, _ in inside:
                if abs(split[0] - rec[0]) + abs(split[1] - rec[1]) < distance:
                    toward = t - start
                    break
        switches: dict[str, int] = {}
        previous = (timeline[timeline.index(inside[0]) - 1][2] if timeline.index(inside[0]) else inside[0][2])
        for _, _, roles, _ in inside:
            for address, role in roles.items():
                if address in previous and previous[address] != role:
                    switches[address] = switches.get(address, 0) + 1
            previous = {**previous, **roles}
        out.append(f"phase {number}: split {first_split[0]}P+{first_split[1]}D at its start -> {inside[-1][1][0]}P+"
                   f"{inside[-1][1][1]}D at its end; recommendation {rec[0]}P+{rec[1]}D" if rec else
                   f"phase {number}: split {first_split} -> {inside[-1][1]}")
        out.append(f"  first change toward it: {'%.0f s after the shift' % toward if toward is not None else 'none'}; "
                   f"most switches of one worker: {max(switches.values(), default=0)}; streams moved by rebalancing: "
                   f"{moved[0]}, by migration: {moved[1]}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase-s", type=float, default=120)
    p.add_argument("--rate", type=float, default=1.25, help="requests per second, Poisson")
    p.add_argument("--phase1", default="1000:8", help="PROMPT:OUTPUT tokens of phase 1")
    p.add_argument("--phase2", default="48:300", help="PROMPT:OUTPUT tokens of phase 2")
    p.add_argument("--workers", type=int, default=6, help="--max-workers of the autoscaled cluster")
    p.add_argument("--initial", default="4:2", help="P:D, the static split and the autoscaled cluster's start")
    p.add_argument("--ttft-ms", type=float, default=5000)
    p.add_argument("--tpot-ms", type=float, default=120)
    p.add_argument("--percentile", type=float, default=90)
    p.add_argument("--interval-s", type=float, default=2)
    p.add_argument("--window-s", type=float, default=20)
    p.add_argument("--cooldown-s", type=float, default=8)
    p.add_argument("--min-per-role", type=int, default=2, help="planner_config.min_per_role")
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--model", default=None, help="a checkpoint folder: real workers (default: simulated)")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="seed the planner with `pdserve profile` of a worker of each role (--no-profile: live "
                        "timings only)")
    p.add_argument("--setups", default="autoscale,static")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    phases = [Phase(*(int(x) for x in args.phase1.split(":"))), Phase(*(int(x) for x in args.phase2.split(":")))]
    requests = plan_requests(args, phases)
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-autoscale-"))
    recs = [recommendation(args, phase) for phase in phases]
    print(f"# bench/autoscale.py on {git_describe(REPO)}, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores; "
          f"{'model ' + args.model if args.model else 'simulated workers ' + json.dumps(SIM)}")
    print(f"# {len(requests)} requests at {args.rate}/s; phase 1 {phases[0]}, phase 2 {phases[1]}, {args.phase_s:g} s "
          f"each; SLOs p{args.percentile:g} TTFT <= {args.ttft_ms:g} ms, TPOT <= {args.tpot_ms:g} ms; logs {log_dir}")
    if args.profile:
        print(f"[{time.strftime('%H:%M:%S')}] pdserve profile of a worker of each role", file=sys.stderr, flush=True)
    profiles = profile_workers(args, log_dir)
    rows, timelines = {}, {}
    for setup in args.setups.split(","):
        results, timeline = run(args, setup == "autoscale", requests, log_dir, profiles)
        rows[setup] = [summarise(results, n, args) for n in (1, 2)]
        timelines[setup] = timeline
    print("\n| cluster | phase | requests | failed | SLO attainment | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | "
          "TPOT p90 ms | output tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for setup, phases_rows in rows.items():
        for n, row in enumerate(phases_rows, 1):
            print(f"| {setup} | {n} | {row['requests']} | {row['failed']} | {row['attainment']:.3f} | "
                  f"{row['ttft_p50']:.0f} | {row['ttft_p90']:.0f} | {row['tpot_p50']:.1f} | {row['tpot_p90']:.1f} | "
                  f"{row['tok_s']:.1f} |")
    if "autoscale" in rows and "static" in rows:
        for n in (1, 2):
            a, s = rows["autoscale"][n - 1], rows["static"][n - 1]
            print(f"phase {n}: attainment autoscale/static {a['attainment']:.3f}/{s['attainment']:.3f}; "
                  f"TTFT p50 ratio {a['ttft_p50'] / s['ttft_p50']:.2f}x; tok/s ratio {a['tok_s'] / s['tok_s']:.2f}x")
    if "autoscale" in timelines:
        print("\n" + "\n".join(moves(timelines["autoscale"], args, recs)))
    for setup, phases_rows in rows.items():
        for n, row in enumerate(phases_rows, 1):
            if row["errors"]:
                print(f"{setup} phase {n} errors: {row['errors']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
