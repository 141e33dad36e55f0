"""pdserve and vLLM's own router (`vllm-router`, Rust) in front of the same vLLM prefill + decode pair over NIXL.

    .venv/bin/python bench/vllm_router.py                       # the embedded model, defaults below
    .venv/bin/python bench/vllm_router.py --model ~/.cache/pdserve/models/SmolLM2-135M-Instruct --rounds 3

Needs the vLLM environment (`make vllm-env`); `vllm-router` is installed into it on first use (a wheel from PyPI).
1. One vLLM prefill instance (kv_producer) and one decode instance (kv_consumer) start as `pdserve up --engine vllm`
   starts them (launcher/vllm_serve.py), each on a core of its own.
2. The pdserve coordinator (engine vllm, round_robin) and `vllm-router --vllm-pd-disaggregation --prefill URL
   --decode URL` start in front of them, both routing every request through the same NIXL handshake.
3. The same closed-loop load goes through each in turn, `--rounds` times (alternating, so drift in the machine
   hits both): `--concurrency` clients, each sending streamed /v1/completions of a ~`--prompt-tokens` prompt of
   random words and `--max-tokens` tokens (ignore_eos) until `--requests` are done. Every round of every stack
   has prompts of its own, so neither finds the other's in vLLM's prefix caches.
4. Per round: the router process's CPU seconds per request (its whole process tree), TTFT (to the first body byte)
   p50 / p90 at the client, output tokens/s, and the TCP connections the machine opened (the kernel's ActiveOpens,
   less the load generator's own) per request: a router that keeps its connections to the instances alive opens
   none in steady state. The table gives each stack's median round, tokens relayed per CPU second, and pdserve's
   ratios; the issue's target: CPU per request at most 1.5x the Rust router's, TTFT and tokens/s within 10%.
`--mock-engines` puts two mock instances (bench/mock_vllm.py) in place of the vLLM pair: the routers' own cost,
with nothing competing for their core (the routers on core 0, the mocks and the load on the others).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.coordinator import Process, cpu_seconds, percentile  # noqa: E402
from bench.stream_client import StreamClient  # noqa: E402
from launcher.vllm_fleet import default_vllm_venv, free_port  # noqa: E402

ROUTER_SPEC = "vllm-router==0.1.17"
WORDS = ("alpha beta gamma delta river stone cloud paper light window garden summer number yellow quiet "
         "market engine letter forest mirror silver candle orange planet").split()
CPU_TARGET, LATENCY_TOLERANCE = 1.5, 0.10


@dataclass
class Round:
    stack: str
    cpu_ms_per_request: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    tokens_per_s: float
    requests: int
    new_connections_per_request: float = 0.0  # TCP connections the machine opened, less the load's own


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and every process below it."""
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            total += cpu_seconds(current)
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        todo.extend(int(c) for c in children)
    return total


def tcp_active_opens() -> int:
    """The kernel's count of TCP connections this machine opened (/proc/net/snmp, Tcp: ActiveOpens)."""
    lines = [line.split() for line in Path("/proc/net/snmp").read_text().splitlines() if line.startswith("Tcp:")]
    return int(lines[1][lines[0].index("ActiveOpens")])


def wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout_s}s")


def ensure_router(venv: Path) -> Path:
    exe = venv / "bin" / "vllm-router"
    if not exe.exists():
        print(f"installing {ROUTER_SPEC} into {venv} ...", flush=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", ROUTER_SPEC], check=True)
    return exe


def prompt(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


async def run_round(stack: str, url: str, pid: int, args, seed: int) -> Round:
    rng = random.Random(seed)
    client = StreamClient(url)
    bodies = [client.request("/v1/completions", json.dumps({
        "model": args.name, "prompt": prompt(rng, args.prompt_tokens), "max_tokens": args.max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode())
        for _ in range(args.requests)]
    ttfts: list[float] = []
    tokens = 0

    async def worker():
        nonlocal tokens
        while bodies:
            body = bodies.pop()
            start = time.perf_counter()
            status, answer, first = await client.post(body)
            if status != 200:
                raise RuntimeError(f"{stack} answered {status}: {answer[:300]!r}")
            usage = [json.loads(e[6:]) for e in answer.split(b"\n\n") if e.startswith(b"data: {")][-1]["usage"]
            tokens += usage["completion_tokens"]
            ttfts.append(first - start)

    opens_before = tcp_active_opens()
    cpu_before, started = tree_cpu_seconds(pid), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    elapsed, cpu = time.perf_counter() - started, tree_cpu_seconds(pid) - cpu_before
    # The router's (the engines open none to it; nothing else runs here during a round).
    opened = tcp_active_opens() - opens_before - client.dialled
    client.close()
    return Round(stack, cpu * 1000 / args.requests, percentile(ttfts, 0.5) * 1000, percentile(ttfts, 0.9) * 1000,
                 tokens / elapsed, args.requests, opened / args.requests)


def median_round(rounds: list[Round]) -> Round:
    pick = {f: statistics.median(getattr(r, f) for r in rounds)
            for f in ("cpu_ms_per_request", "ttft_p50_ms", "ttft_p90_ms", "tokens_per_s",
                      "new_connections_per_request")}
    return Round(rounds[0].stack, requests=sum(r.requests for r in rounds), **pick)


def print_table(args, results: dict[str, Round]) -> None:
    ours, theirs = results["pdserve"], results["vllm-router"]
    engines = "two mock vLLM instances (bench/mock_vllm.py)" if args.mock_engines else \
        "one vLLM prefill + decode pair (NIXL)"
    print(f"\n## pdserve vs vllm-router over {engines}, {os.cpu_count()} cores")
    print(f"model {args.model}; {args.rounds} rounds x {args.requests} streamed completions per stack, "
          f"{args.concurrency} at a time, ~{args.prompt_tokens}-word prompts, {args.max_tokens} tokens each; "
          "medians of the rounds\n")
    print("| router | CPU ms / request | TTFT p50 ms | TTFT p90 ms | output tokens/s | tokens / CPU s | "
          "new TCP connections / request |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in [theirs, ours] + [r for name, r in results.items() if name not in ("pdserve", "vllm-router")]:
        print(f"| {r.stack} | {r.cpu_ms_per_request:.2f} | {r.ttft_p50_ms:.0f} | {r.ttft_p90_ms:.0f} | "
              f"{r.tokens_per_s:.1f} | {args.max_tokens * 1000 / r.cpu_ms_per_request:,.0f} | "
              f"{r.new_connections_per_request:.2f} |")
    cpu = ours.cpu_ms_per_request / theirs.cpu_ms_per_request
    ttft = ours.ttft_p50_ms / theirs.ttft_p50_ms
    tps = ours.tokens_per_s / theirs.tokens_per_s
    print(f"| **pdserve / vllm-router** | **{cpu:.2f}x** (target <= {CPU_TARGET}x) | **{ttft:.2f}x** | "
          f"{ours.ttft_p90_ms / theirs.ttft_p90_ms:.2f}x | **{tps:.2f}x** | | |")
    for name, other in results.items():
        if name not in ("pdserve", "vllm-router"):
            print(f"| pdserve / {name} | {ours.cpu_ms_per_request / other.cpu_ms_per_request:.2f}x | "
                  f"{ttft * theirs.ttft_p50_ms / other.ttft_p50_ms:.2f}x | | "
                  f"{ours.tokens_per_s / other.tokens_per_s:.2f}x | | |")
    ok = cpu <= CPU_TARGET and abs(ttft - 1) <= LATENCY_TOLERANCE and abs(tps - 1) <= LATENCY_TOLERANCE
    print(f"\ntarget (CPU <= {CPU_TARGET}x, TTFT and tokens/s within {LATENCY_TOLERANCE:.0%}): "
          f"{'met' if ok else 'NOT met'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    p.add_argument("--vllm-venv", type=Path, default=default_vllm_venv())
    p.add_argument("--requests", type=int, default=48, help="requests per round and stack")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=200, help="words per prompt (about a token each)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--mock-engines", action="store_true", help="mock vLLM instances (bench/mock_vllm.py) instead of "
                   "a real pair: the routers' own CPU, without engines competing for the cores")
    p.add_argument("--decode-step-ms", type=float, default=5.0, help="with --mock-engines: one decode step")
    p.add_argument("--against", type=Path, metavar="DIR", help="a second pdserve coordinator from another checkout "
                   "(git worktree add /tmp/base HEAD~1), its rounds taking turns with the others")
    args = p.parse_args()
    if args.model is None:
        from embedded_model import ensure_default_model
        args.model = str(ensure_default_model())
    args.name = Path(args.model).name  # what the coordinator serves it as, and vLLM too (for vllm-router's clients)
    router_exe = ensure_router(args.vllm_venv)
    from launcher.vllm_fleet import plan_instances

    with tempfile.TemporaryDirectory(prefix="bench-vllm-router-") as tmp:
        started: list[Process] = []
        router = None
        try:
            cpus = os.cpu_count() or 1
            if args.mock_engines:
                # The routers share core 0; the mock instances and the load generator have the others.
                print("starting two mock vLLM instances ...", flush=True)
                others = set(range(1, cpus)) or {0}
                mock = Process([sys.executable, str(REPO / "bench" / "mock_vllm.py"), "--name", args.name,
                                "--decode-step-ms", str(args.decode_step_ms)], "mock vllm ready:", cpus=others)
                started.append(mock)
                prefill, decode = mock.ready_line.split()[-2:]
                entries = [{"engine": "vllm", "url": url, "kv_events": ""} for url in (prefill, decode)]
                router_cpus = {0}
                os.sched_setaffinity(0, others)
            else:
                instances = plan_instances(1, 1, Path(tmp))
                print("starting a vLLM prefill + decode pair ...", flush=True)
                for instance in instances:
                    started.append(Process(instance.argv(args.vllm_venv, args.model, served_name=args.name),
                                           "pdserve worker ready:", cpus={instance.index % cpus}))
                prefill, decode = (f"http://127.0.0.1:{i.port}" for i in instances)
                entries = [i.entry("http") | {"kv_events": ""} for i in instances]
                router_cpus = set(range(cpus))
            config = Path(tmp) / "coordinator.json"
            config.write_text(json.dumps({
                "http_config": {"predict_ip": "127.0.0.1", "predict_port": 0, "manage_port": 0},
                "model_config": {"modelWeightPath": args.model, "maxSeqLen": 2048, "maxInputTokenLen": 2048},
                "instances": {"prefill": [entries[0]], "decode": [entries[1]]}}))
            coordinators = {"pdserve": REPO}
            if args.against:
                coordinators[f"pdserve at {args.against.name}"] = args.against
            stacks: dict[str, tuple[str, int]] = {}
            for name, checkout in coordinators.items():
                coordinator = Process([sys.executable, "-m", "launcher.cli", "coordinator", "--config", str(config)],
                                      "pdserve coordinator ready:", cpus=router_cpus, cwd=checkout)
                started.append(coordinator)
                stacks[name] = (coordinator.address, coordinator.proc.pid)
            router_port = free_port()
            router = subprocess.Popen(["taskset", "-c", ",".join(map(str, sorted(router_cpus))), str(router_exe),
                                       "--vllm-pd-disaggregation", "--prefill", prefill,
                                       "--decode", decode, "--host", "127.0.0.1", "--port", str(router_port),
                                       "--policy", "round_robin", "--log-level", "warning",
                                       # its metrics exporter binds 0.0.0.0:29000 unless told otherwise
                                       "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            router_url = f"http://127.0.0.1:{router_port}"
            wait_http(router_url + "/health", 60)
            stacks["vllm-router"] = (router_url, router.pid)
            for seed, (name, (url, pid)) in enumerate(stacks.items()):  # warm both paths (handshakes, connections)
                warm = argparse.Namespace(**{**vars(args), "requests": args.concurrency})
                asyncio.run(run_round(name, url, pid, warm, seed=seed))
            rounds: dict[str, list[Round]] = {name: [] for name in stacks}
            for i in range(args.rounds):
                for name, (url, pid) in (stacks.items() if i % 2 == 0 else reversed(stacks.items())):
                    # Prompts of their own per round and stack: the same ones again would hit vLLM's prefix
                    # caches for whichever stack came second.
                    seed = 1000 + len(stacks) * i + list(stacks).index(name)
                    result = asyncio.run(run_round(name, url, pid, args, seed=seed))
                    rounds[name].append(result)
                    print(f"round {i + 1} {name}: {result.cpu_ms_per_request:.2f} CPU ms/request, TTFT p50 "
                          f"{result.ttft_p50_ms:.0f} ms, {result.tokens_per_s:.1f} tokens/s", flush=True)
            print_table(args, {name: median_round(r) for name, r in rounds.items()})
        finally:
            if router is not None:
                router.kill()
                router.wait()
            for process in reversed(started):
                try:
                    process.stop()
                except subprocess.TimeoutExpired:  # the rest must still be stopped
                    process.proc.kill()


if __name__ == "__main__":
    main()
