"""LoRA adapters under load: pdserve serving four PEFT adapters and the base model, against pdserve serving the
base model alone and against vLLM's CPU build serving the same adapters, in one run.

    .venv/bin/python bench/lora.py --concurrency 16 64
    .venv/bin/python bench/lora.py --requests 8 --concurrency 4 --max-tokens 16          # smoke

Three targets, each started by this script on free 127.0.0.1 ports, measured at every concurrency and stopped
before the next one starts (never two at once: they would share the cores). bench/serving.py's targets, client,
prompts and figures are reused as they are (its docstring describes them):

- `base only`: `pdserve up --model DIR --predict-port P` (1 prefill + 1 decode worker, their defaults: up to 4
  adapters resident, none configured); every request names the base model.
- `4 adapters + base`: `pdserve up --model DIR --lora a1=PATH ... --lora a4=PATH --predict-port P`; request i
  names a1, a2, a3, a4, base, a1, ... (round-robin), so most batches mix all five.
- `vllm 4 adapters + base`: `vllm serve DIR --dtype float32 --max-model-len 4096 --enable-lora --max-lora-rank R
  --max-loras 4 --lora-modules a1=PATH ...` with VLLM_CPU_KVCACHE_SPACE=4; the same spread of requests.
- `vllm base only` (`--targets ... vllm-base`, not in the default): `vllm serve DIR` without LoRA, every request
  to the base model: what vLLM's LoRA path itself costs on this machine.

The adapters: `--count` (4) PEFT adapters of rank `--rank` (8) on every projection, built once by
`python -m embedded_model.lora_adapters` into `<model>-loras` beside the model folder (kept for later runs).

Correctness, before any load: one greedy request per adapter (and one to the base model) to both servers that
serve the adapters, streamed /v1/completions of a fixed prompt, temperature 0, `--check-tokens` (24) new tokens,
no ignore_eos; a line per model says whether pdserve's text and vLLM's are equal, and whether each adapter's text
differs from the base model's (it should: the adapters are built so that they change greedy output).

The load: bench/serving.py's `distinct` workload (`--requests` (64) streamed /v1/completions, each a distinct
350-token prompt, the same prompts on every target), temperature 0, ignore_eos, `--max-tokens` (64) new tokens.
Per (target, concurrency): ok/sent, errors (counted by kind), output tokens/s (completion tokens of the successful
requests / wall time of the load), TTFT p50 / p99, and the 1-minute load average when the load started (the
machine may be shared). Ratios: `4 adapters + base` / `base only` (target >= 0.85x) and pdserve's `4 adapters +
base` / vLLM's (target >= 1.0x), on output tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.serving import (DEFAULT_MODEL, SHOW_ERRORS, PdserveTarget, PromptMaker, Run, StartFailed,  # noqa: E402
                           Target, VllmTarget, Workload, error_kind, fmt, make_workloads, measure, ratio,
                           request_body, stream_request, warm_up)

BASE, MIXED, VLLM, VLLM_BASE = "base only", "4 adapters + base", "vllm 4 adapters + base", "vllm base only"
TARGETS = {"base": BASE, "adapters": MIXED, "vllm": VLLM, "vllm-base": VLLM_BASE}
DEFAULT_TARGETS = ["base", "adapters", "vllm"]
TARGET_MIXED_VS_BASE = 0.85
TARGET_MIXED_VS_VLLM = 1.0
CHECK_PROMPT = "The lighthouse keeper opened the old logbook and read the first entry aloud:"


def log(msg: str) -> None:
    print(f"[lora {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_adapters(model: str, count: int, rank: int) -> dict[str, str]:
    """Adapters a1 ... a`count` of `model` in `<model>-loras` (built once), by the builder's own command line."""
    out = Path(model).resolve().parent / f"{Path(model).resolve().name}-loras"
    cmd = [sys.executable, "-m", "embedded_model.lora_adapters", "--model", model, "--out", str(out),
           "--count", str(count), "--rank", str(rank)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"`{shlex.join(cmd)}` failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return dict(re.findall(r"^(\w+)=(\S+)$", proc.stdout, re.M))


def base_model_id(target: Target, adapters: dict[str, str]) -> str:
    """The base model's id in /v1/models (the first entry that is not one of the adapters)."""
    status, body = target.get("/v1/models")
    ids = [m["id"] for m in json.loads(body)["data"]] if status == 200 else []
    return next((i for i in ids if i not in adapters), target.model_id)


def spread_workload(distinct: Workload, adapter_names: list[str], args) -> Workload:
    """`distinct`'s prompts, request i naming (adapters + the base model)[i % n]; no adapters: all to the base."""

    async def run(session, base_url, model_id, concurrency, texts):
        models = adapter_names + [model_id]
        sem = asyncio.Semaphore(concurrency)

        async def one(i, text):
            async with sem:
                return await stream_request(session, base_url + "/v1/completions",
                                            request_body(args, models[i % len(models)], prompt=text))
        return await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))

    return Workload(distinct.name, distinct.title, distinct.unit, distinct.levels, distinct.prepare, run)


async def greedy_texts(target: Target, models: dict[str, str], args) -> dict[str, str]:
    """One greedy completion of CHECK_PROMPT per (label -> model id); the text, or `ERROR: ...`."""
    import aiohttp

    texts = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout)) as session:
        for label, model_id in models.items():
            body = request_body(args, model_id, prompt=CHECK_PROMPT, max_tokens=args.check_tokens)
            body.pop("ignore_eos", None)
            outcome = await stream_request(session, target.base_url + "/v1/completions", body)
            texts[label] = outcome.text if outcome.ok else f"ERROR: {outcome.error}"
    return texts


def check_lines(texts: dict[str, dict[str, str]], labels: list[str]) -> list[str]:
    pd, vl = texts.get(MIXED), texts.get(VLLM)
    lines = [f"Greedy check: {len(labels)} streamed /v1/completions of `{CHECK_PROMPT}` per server, temperature 0, "
             f"no ignore_eos; pdserve `{MIXED}` against vLLM:", ""]
    for label in labels:
        if pd is None or vl is None:
            lines.append(f"- {label}: not compared (no answers from `{MIXED if pd is None else VLLM}` in this run)")
            continue
        a, b = pd.get(label, ""), vl.get(label, "")
        verdict = "equal" if a == b and not a.startswith("ERROR") else "differs"
        vs_base = "" if label == "base" else (
            "; differs from the base model's" if a != pd.get("base") else "; SAME as the base model's")
        lines.append(f"- {label}: {verdict}{vs_base}: pdserve {json.dumps(a)}"
                     + ("" if verdict == "equal" else f", vLLM {json.dumps(b)}"))
    return lines


def results_table(runs: dict[tuple[str, int], Run], loads: dict[tuple[str, int], float], targets: list[str],
                  levels: list[int]) -> list[str]:
    lines = ["| target | concurrency | ok/sent | errors | output tok/s | TTFT p50 s | TTFT p99 s | load 1m |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for c in levels:
        for t in targets:
            r = runs.get((t, c))
            if r is None:
                continue
            if r.skipped:
                lines.append(f"| {t} | {c} | – | {r.skipped.splitlines()[0][:80]} | – | – | – | – |")
                continue
            lines.append(f"| {t} | {c} | {len(r.ok)}/{r.sent} | {len(r.errors)} | {fmt(r.tokens_per_s, '.1f')} | "
                         f"{fmt(r.ttft(0.5), '.2f')} | {fmt(r.ttft(0.99), '.2f')} | {loads.get((t, c), 0):.1f} |")
            if r.errors:
                kinds = collections.Counter(error_kind(e) for e in r.errors)
                notes.append(f"- {t} at {c}: {len(r.errors)} failed: " + "; ".join(
                    f"{n} x `{kind[:300]}`" for kind, n in kinds.most_common(SHOW_ERRORS)))
    return lines + (["", "Errors:"] + notes if notes else [])


def ratio_table(runs: dict[tuple[str, int], Run], levels: list[int]) -> list[str]:
    def figure(t, c, what):
        r = runs.get((t, c))
        if r is None or r.skipped:
            return None
        return r.tokens_per_s if what == "tok/s" else r.ttft(0.5)

    def verdict(a, b, goal):
        return "–" if a is None or not b else ("met" if a / b >= goal else "**not met**")

    lines = [f"| concurrency | tok/s: {MIXED} / {BASE} | target >= {TARGET_MIXED_VS_BASE}x | TTFT p50: {MIXED} / "
             f"{BASE} | tok/s: {MIXED} / vLLM | target >= {TARGET_MIXED_VS_VLLM}x | TTFT p50: {MIXED} / vLLM |",
             "|---:|---:|---|---:|---:|---|---:|"]
    for c in levels:
        mixed, base, vllm = (figure(t, c, "tok/s") for t in (MIXED, BASE, VLLM))
        lines.append(f"| {c} | {ratio(mixed, base)} | {verdict(mixed, base, TARGET_MIXED_VS_BASE)} | "
                     f"{ratio(figure(MIXED, c, 'ttft'), figure(BASE, c, 'ttft'))} | {ratio(mixed, vllm)} | "
                     f"{verdict(mixed, vllm, TARGET_MIXED_VS_VLLM)} | "
                     f"{ratio(figure(MIXED, c, 'ttft'), figure(VLLM, c, 'ttft'))} |")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(formatter_class=argparse.RawDescriptionHelpFormatter,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the checkpoint (default: `make real-model`'s, "
                                                         f"{DEFAULT_MODEL})")
    p.add_argument("--targets", nargs="+", default=DEFAULT_TARGETS, choices=list(TARGETS),
                   help="base (pdserve, base only), adapters (pdserve, 4 adapters + base), vllm (vLLM, 4 adapters + "
                        "base), vllm-base (vLLM without --enable-lora, base only; not in the default: base adapters "
                        "vllm)")
    p.add_argument("--count", type=int, default=4, help="adapters a1 ... aN (default 4)")
    p.add_argument("--rank", type=int, default=8, help="the adapters' LoRA rank (default 8)")
    p.add_argument("--vllm-venv", type=Path, default=REPO / ".vllm-venv", help="venv made by bench/vllm_env.sh")
    p.add_argument("--pdserve-args", default="", help="extra arguments for both pdserve targets' `pdserve up`")
    p.add_argument("--vllm-args", default="", help="extra arguments for `vllm serve`")
    p.add_argument("--concurrency", nargs="+", type=int, default=[16, 64])
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level (default 64)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default 64)")
    p.add_argument("--check-tokens", type=int, default=24, help="new tokens of each greedy check (default 24)")
    p.add_argument("--request-timeout", type=float, default=900, help="seconds one request may take (client side)")
    p.add_argument("--start-timeout", type=float, default=600, help="seconds a target may take to become ready")
    p.add_argument("--settle", type=float, default=60, help="before each load, wait up to this long for /health 200")
    p.add_argument("--log-dir", type=Path, default=None, help="where the targets' logs go (default: a temp folder)")
    p.add_argument("--json", type=Path, default=None, help="also write every run's figures to this file")
    p.set_defaults(ignore_eos=True, sessions=1, turns=1)  # what bench/serving.py's workloads read
    args = p.parse_args(argv)
    if not (Path(args.model) / "config.json").exists():
        p.error(f"--model {args.model}: no config.json there (`make real-model` builds the default)")
    if min(args.concurrency) < 1 or args.requests < 1 or args.max_tokens < 1 or args.count < 1:
        p.error("--concurrency, --requests, --max-tokens and --count must be >= 1")
    return args


def build_targets(args, adapters: dict[str, str], log_dir: Path) -> list[tuple[Target, list[str]]]:
    """(target, the adapter names its requests spread over) for each chosen target, in the order given."""
    common = (args.model, log_dir, args.start_timeout)
    loras = [f"{name}={path}" for name, path in adapters.items()]
    pdserve_args = shlex.split(args.pdserve_args)
    out = []
    for key in args.targets:
        name = TARGETS[key]
        if key == "base":
            out.append((PdserveTarget(name.replace(" ", "-"), REPO, *common, extra_args=pdserve_args), []))
        elif key == "adapters":
            lora_args = [a for spec in loras for a in ("--lora", spec)]
            out.append((PdserveTarget(name.replace(" ", "-").replace("+", "plus"), REPO, *common,
                                      extra_args=lora_args + pdserve_args), list(adapters)))
        elif key == "vllm-base":
            out.append((VllmTarget("vllm-base", args.vllm_venv, *common, extra_args=shlex.split(args.vllm_args)), []))
        else:
            vllm_args = ["--enable-lora", "--max-lora-rank", str(args.rank), "--max-loras", str(len(adapters)),
                         "--lora-modules", *loras, *shlex.split(args.vllm_args)]
            out.append((VllmTarget("vllm-adapters", args.vllm_venv, *common, extra_args=vllm_args), list(adapters)))
        out[-1][0].name = name
    return out


def run_target(target: Target, names: list[str], adapters: dict[str, str], distinct: Workload, args,
               runs: dict, loads: dict, texts: dict) -> str:
    """Start `target`, check its greedy output (adapter targets), measure every level into `runs`; what happened,
    for the header. The caller stops it."""
    log(f"{target.name}: starting")
    try:
        target.start()
    except StartFailed as exc:
        log(f"{target.name}: {exc}")
        for c in distinct.levels:
            runs[(target.name, c)] = Run(target.name, "distinct", c, skipped=f"did not start: {exc}")
        return f"did not start: {exc}"
    target.model_id = base_model_id(target, adapters)
    log(f"{target.name}: ready in {target.startup_s:.0f}s at {target.base_url}, base model {target.model_id}")
    status = f"ready in {target.startup_s:.0f} s: `{shlex.join(target.command)}`"
    failed_warm_up = asyncio.run(warm_up(target, args))
    if failed_warm_up:
        log(f"{target.name}: the warm-up failed: {failed_warm_up}")
    if names:  # the greedy check, which also loads every adapter before the clock starts
        texts[target.name] = asyncio.run(greedy_texts(target, {**{n: n for n in names}, "base": target.model_id},
                                                      args))
        for label, text in texts[target.name].items():
            log(f"{target.name}: greedy {label}: {text!r}")
    workload = spread_workload(distinct, names, args)
    for c in distinct.levels:
        if target.proc.poll() is not None:
            why = f"{target.name} exited with {target.proc.returncode} during the load"
            log(f"{why}; log {target.log_path}:\n{target.log_tail(40)}")
            status += f"; {why}"
            runs[(target.name, c)] = Run(target.name, "distinct", c, skipped=why)
            continue
        if not target.wait_healthy(args.settle):
            log(f"{target.name}: /health not 200 after {args.settle:g} s; measuring anyway")
        loads[(target.name, c)] = os.getloadavg()[0]
        outcomes, wall = asyncio.run(measure(workload, target, c, args.request_timeout))
        run = runs[(target.name, c)] = Run(target.name, "distinct", c, outcomes, wall)
        log(f"{target.name}: c={c}: {len(run.ok)}/{run.sent} ok, {fmt(run.tokens_per_s, '.1f')} tok/s, "
            f"TTFT p50 {fmt(run.ttft(0.5), '.2f')} s, wall {wall:.1f} s")
        for error in run.errors[:SHOW_ERRORS]:
            log(f"{target.name}: c={c} error: {error}")
    return status


def main(argv=None) -> int:
    args = parse_args(argv)
    command = shlex.join([os.path.relpath(sys.executable) if not os.path.relpath(sys.executable).startswith("..")
                          else sys.executable, sys.argv[0]] + (sys.argv[1:] if argv is None else argv))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-lora-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log(f"building / finding {args.count} rank-{args.rank} adapters of {args.model} ...")
    adapters = build_adapters(args.model, args.count, args.rank)
    log("adapters: " + " ".join(f"{k}={v}" for k, v in adapters.items()))
    distinct = make_workloads(args, PromptMaker(args.model))["distinct"]
    targets = build_targets(args, adapters, log_dir)
    log(f"targets' logs in {log_dir}")

    runs: dict[tuple[str, int], Run] = {}
    loads: dict[tuple[str, int], float] = {}
    started: dict[str, str] = {}
    texts: dict[str, dict[str, str]] = {}
    for target, names in targets:
        try:
            started[target.name] = run_target(target, names, adapters, distinct, args, runs, loads, texts)
        finally:
            target.stop()

    names = [t.name for t, _ in targets]
    out = [f"## bench/lora.py, {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs", "",
           f"Command: `{command}`", "",
           f"Model: `{args.model}`; adapters: {', '.join(f'`{k}`' for k in adapters)} (rank {args.rank}) in "
           f"`{Path(next(iter(adapters.values()))).parent}`. Load: {distinct.title}; requests spread round-robin "
           f"over {' '.join(adapters)} and the base model on the adapter targets. Targets (one at a time):"]
    out += [f"- `{t.name}`: {t.description}; {started.get(t.name, 'not run')}" for t, _ in targets]
    if MIXED in texts or VLLM in texts:
        out += [""] + check_lines(texts, list(adapters) + ["base"])
    out += ["", *results_table(runs, loads, names, distinct.levels)]
    if MIXED in names and (BASE in names or VLLM in names):
        out += ["", *ratio_table(runs, distinct.levels)]
    if VLLM in names and VLLM_BASE in names:
        out += ["", f"| concurrency | tok/s: {VLLM} / {VLLM_BASE} | TTFT p50: {VLLM} / {VLLM_BASE} |",
                "|---:|---:|---:|"]
        out += [f"| {c} | {ratio(runs[(VLLM, c)].tokens_per_s, runs[(VLLM_BASE, c)].tokens_per_s)} | "
                f"{ratio(runs[(VLLM, c)].ttft(0.5), runs[(VLLM_BASE, c)].ttft(0.5))} |" for c in distinct.levels]
    print("\n".join(out))

    if args.json:
        args.json.write_text(json.dumps({
            "command": command, "model": args.model, "adapters": adapters, "greedy": texts,
            "runs": [{"target": r.target, "concurrency": r.concurrency, "sent": r.sent, "ok": len(r.ok),
                      "errors": r.errors, "wall_s": r.wall_s, "tokens_per_s": r.tokens_per_s,
                      "ttft_p50_s": r.ttft(0.5), "ttft_p99_s": r.ttft(0.99), "load_1m": loads.get(key),
                      "skipped": r.skipped} for key, r in runs.items()]}, indent=1))
    return 0 if all(not r.skipped for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
