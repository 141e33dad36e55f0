"""A long prefix another worker holds: pulled (peer pull) against computed, on real workers and the real checkpoint.

    .venv/bin/python bench/kv_pull.py [--prefix-tokens 2000] [--repeats 3] [--model DIR]

The fleet (fresh per mode): one prefill and one decode `pdserve worker` on `--model` (default: the real checkpoint,
SmolLM2-135M-Instruct) and a coordinator with `cache_affinity`. The prefill worker's pool holds
`--prefill-pool-tokens` (2,600: one long prefix and a little), the decode worker's 16,384, so the decode worker
keeps conversations the prefill worker has to evict. Per repeat, with a new prefix X of `--prefix-tokens`:

1. `cold`: X + question 1, computed from scratch.
2. Two 1,300-token fillers: the prefill worker's pool evicts X; the decode worker still holds it.
3. `follow-up`: X + question 2. With `pulls` the coordinator has the prefill worker pull X's blocks from the
   decode worker (`pdserve_worker_kv_pulls_total{outcome="pulled"}` counts them); with `no pulls`
   (`cache_affinity_peer_pulls: false`) it computes them again.
4. `pool hit`: X + question 3, now in the prefill worker's pool.

TTFT at the client (one streamed /v1/completions at a time, greedy, 16 new tokens); medians over the repeats.
The follow-up's tokens are compared across the modes (greedy: they must be identical).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from bench.routing import Proc, python_of, stop_all, wait_healthy  # noqa: E402
from bench.serving import DEFAULT_MODEL, PromptMaker, http_get  # noqa: E402

START_TIMEOUT_S = 300
FILLER_TOKENS, QUESTION_TOKENS, NEW_TOKENS = 1300, 30, 16
STEPS = ("cold", "follow-up", "pool hit")


def start(model: str, pulls: bool, prefill_pool: int, log_dir: Path, tag: str) -> tuple[list[Proc], str, str]:
    python = python_of(REPO)
    procs, workers = [], []
    for role, pool in (("prefill", prefill_pool), ("decode", 16384)):
        argv = [python, "-m", "launcher.cli", "worker", "--role", role, "--port", "0", "--model", model,
                "--metrics-port", "0", "--kv-budget-tokens", str(pool)]
        procs.append(Proc(f"{tag} {role}", argv, REPO, log_dir / f"{tag}-{role}.log"))
        workers.append(procs[-1])
    deadline = time.monotonic() + START_TIMEOUT_S
    addresses = [w.line_value("pdserve worker ready:", deadline).split("=", 1)[-1] for w in workers]
    metrics = workers[0].line_value("pdserve worker metrics:", deadline)
    config = {"http_config": {"predict_ip": "127.0.0.1", "predict_port": 0, "manage_port": 0},
              "model_config": {"modelName": "smollm2", "modelWeightPath": model, "maxSeqLen": 4096,
                               "maxInputTokenLen": 4096},
              "instances": {"prefill": [{"address": addresses[0]}], "decode": [{"address": addresses[1]}]},
              "digs_scheduler_config": {"algorithm_type": "cache_affinity", "cache_affinity_peer_pulls": pulls},
              "exception_config": {"first_token_timeout": 300, "infer_timeout": 600}}
    path = log_dir / f"{tag}-coordinator.json"
    path.write_text(json.dumps(config))
    procs.append(Proc(f"{tag} coordinator", [python, "-m", "launcher.cli", "coordinator", "--config", str(path)],
                      REPO, log_dir / f"{tag}-coordinator.log"))
    url = procs[-1].line_value("pdserve coordinator ready:", deadline).rstrip("/")
    wait_healthy(url, deadline)
    return procs, url, metrics


async def ttft(http: aiohttp.ClientSession, url: str, prompt: str) -> tuple[float, list[int]]:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    started, first, tokens = time.perf_counter(), None, []
    async with http.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            ids = chunk["choices"][0].get("token_ids") or [] if chunk.get("choices") else []
            if ids and first is None:
                first = time.perf_counter() - started
            tokens += ids
    return first, tokens


def pulled(metrics_url: str) -> float:
    _, text = http_get(metrics_url.rstrip("/") + "/metrics")
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith('pdserve_worker_kv_pulls_total{outcome="pulled"}'))


async def run_mode(url: str, texts: list[dict]) -> list[dict]:
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
        await ttft(http, url, "Warm up.")
        for t in texts:
            row = {}
            row["cold"], _ = await ttft(http, url, t["prefix"] + t["questions"][0])
            for filler in t["fillers"]:
                await ttft(http, url, filler)
            row["follow-up"], row["tokens"] = await ttft(http, url, t["prefix"] + t["questions"][1])
            row["pool hit"], _ = await ttft(http, url, t["prefix"] + t["questions"][2])
            out.append(row)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--prefill-pool-tokens", type=int, default=2600)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    prompts, rng = PromptMaker(args.model), random.Random(7)
    texts = [{"prefix": prompts.text(rng, args.prefix_tokens, lead=f"Document {i}."),
              "questions": [f"\n\nQuestion {q}: {prompts.text(rng, QUESTION_TOKENS)}\nAnswer:" for q in range(3)],
              "fillers": [prompts.text(rng, FILLER_TOKENS, lead=f"Filler {i}.{f}.") for f in range(2)]}
             for i in range(args.repeats)]
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-kv-pull-"))
    results, counts = {}, {}
    for mode, on in (("pulls", True), ("no pulls", False)):
        procs, url, metrics = start(args.model, on, args.prefill_pool_tokens, log_dir, mode.replace(" ", "-"))
        try:
            results[mode] = asyncio.run(run_mode(url, texts))
            counts[mode] = pulled(metrics)
        finally:
            stop_all(procs)
        print(f"{mode}: done", file=sys.stderr)
    same = all(a["tokens"] == b["tokens"] for a, b in zip(results["pulls"], results["no pulls"]))
    cold = statistics.median(r["cold"] for m in results.values() for r in m)
    print(f"\nbench/kv_pull.py: `{Path(args.model).name}`, a {args.prefix_tokens}-token prefix, prefill pool "
          f"{args.prefill_pool_tokens} tokens, {args.repeats} repeats (medians); logs `{log_dir}`\n")
    print("| mode | cold TTFT s | follow-up TTFT s | follow-up vs cold | pool hit TTFT s | pulls |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, rows in results.items():
        med = {s: statistics.median(r[s] for r in rows) for s in STEPS}
        print(f"| {mode} | {med['cold']:.3f} | {med['follow-up']:.3f} | {med['follow-up'] / cold:.2f}x | "
              f"{med['pool hit']:.3f} | {counts[mode]:.0f} |")
    print(f"\nFollow-up tokens identical with and without pulls: {same}. Target: a pulled follow-up's TTFT at most "
          f"0.3x cold.")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
