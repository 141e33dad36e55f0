"""Tenants and deadlines on simulated workers through real coordinators (docs/tenants.md).

    .venv/bin/python bench/tenants.py [--parts fairness tokens deadlines] [--seconds 40] [--token-seconds 120]

One simulated prefill and one simulated decode worker (a 20 ms decode step whatever the batch), and coordinators in
front of them holding `request_limit.max_running` = 8 generations on the workers: the rest wait in the coordinator's
line, where tenancy acts. Capacity (requests/s of 32-token answers) is measured first, by a closed loop of 16.

- fairness: tenant A floods (64 clients, each sending its next request as its last ends; a 429 is retried after its
  Retry-After), past its concurrency limit of 48, while tenant B sends Poisson arrivals at 20% of capacity. TTFT
  at the client (send to first token, queueing included). Side by side: the same load on a coordinator without
  tenants (one line, by arrival). Targets: B's TTFT p50 <= 0.25x A's, 0 of B's requests refused or failed; A's
  retries at Retry-After (how many were admitted at the first retry).
- tokens: a tenant with tpm=1000 streams 150-token answers from 2 clients (429s retried after Retry-After) for
  `--token-seconds`; prompt + completion tokens of the requests that ended within it, per minute. Target: within
  10% of 1,000.
- deadlines: MindIE /infer with timeout 2 s and 16-token answers, Poisson at twice what the workers serve (their
  service time at capacity measured first, by a closed loop of 8) for `--seconds`, on a
  coordinator that refuses early and on one that does not (`tenancy_config.refuse_early`). Targets: no request
  waits past its timeout (each served or refused before it; none 504), refusals at most 1.05x an oracle's: a
  replay of the same arrivals on 8 servers of the measured service time that refuses exactly the requests that
  could not finish in time.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from bench.coordinator import Process, pdserve, percentile  # noqa: E402
from bench.serving import git_describe  # noqa: E402
from security.api_keys import hash_key  # noqa: E402

MAX_RUNNING = 8
STEP_MS = 20.0
ANSWER = 32
SIM = ("--simulate", "--sim-prefill-base-ms", "2", "--sim-prefill-ms-per-token", "0", "--sim-decode-base-ms",
       str(STEP_MS), "--sim-decode-ms-per-seq", "0", "--metrics-port", "-1")
KEYS = {"flood": "sk-bench-flood", "light": "sk-bench-light", "metered": "sk-bench-metered"}
CPUS = {0, 1}


@dataclass
class Outcome:
    tenant: str
    sent_at: float
    status: int
    ttft_s: float = 0.0
    ended_at: float = 0.0
    tokens: int = 0  # prompt + completion
    retried: int = 0  # 429s before it was admitted
    first_retry_ok: bool | None = None


def coordinator(tmp: Path, name: str, prefill: str, decode: str, keys: str | None, **tenancy) -> Process:
    config = {"http_config": {"predict_ip": "127.0.0.1", "predict_port": 0, "manage_port": 0},
              "model_config": {"modelName": "pdserve-tiny"},
              "instances": {"prefill": [{"address": prefill}], "decode": [{"address": decode}]},
              "request_limit": {"max_running": MAX_RUNNING}, "tenancy_config": tenancy}
    if keys is not None:
        (tmp / f"{name}-keys").write_text(keys)
        config["auth_config"] = {"api_keys_file": f"{name}-keys"}
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(config))
    return Process(pdserve("coordinator", "--config", str(path)), "pdserve coordinator ready:", CPUS)


async def stream(session: aiohttp.ClientSession, url: str, tenant: str, max_tokens: int, t0: float,
                 retry: bool = True) -> Outcome:
    """One streamed completion as `tenant`; a 429 is retried after its Retry-After when `retry`."""
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"} if tenant in KEYS else {}
    body = {"model": "pdserve-tiny", "prompt": "tell me a story", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    outcome = Outcome(tenant, sent - t0, 0)
    while True:
        start = time.monotonic()
        async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
            outcome.status = resp.status
            if resp.status == 429 and retry and "Retry-After" in resp.headers:
                await resp.read()
                outcome.retried += 1
                await asyncio.sleep(float(resp.headers["Retry-After"]))
                continue
            if resp.status != 200:
                await resp.read()
                break
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                event = json.loads(line[5:])
                if event.get("choices") and not outcome.ttft_s:
                    outcome.ttft_s = time.monotonic() - start  # from the attempt that was admitted
                if event.get("usage"):
                    outcome.tokens = event["usage"]["total_tokens"]
            if outcome.retried:
                outcome.first_retry_ok = outcome.retried == 1
            break
    outcome.ended_at = time.monotonic() - t0
    return outcome


async def closed_loop(url: str, tenant: str, clients: int, seconds: float, max_tokens: int,
                      t0: float) -> list[Outcome]:
    out: list[Outcome] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def client():
            while time.monotonic() - t0 < seconds:
                out.append(await stream(session, url, tenant, max_tokens, t0))
        await asyncio.gather(*(client() for _ in range(clients)))
    return out


async def poisson(url: str, tenant: str, rate: float, seconds: float, t0: float, make=None) -> list:
    rng = random.Random(7)
    tasks, at = [], 0.0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        while True:
            at += rng.expovariate(rate)
            if at >= seconds:
                break
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            tasks.append(asyncio.ensure_future(
                make(session) if make else stream(session, url, tenant, ANSWER, t0, retry=False)))
        return list(await asyncio.gather(*tasks))


async def capacity(url: str) -> float:
    t0 = time.monotonic()
    done = await closed_loop(url, "anonymous", 16, 8.0, ANSWER, t0)
    assert all(o.status == 200 for o in done)
    return len(done) / (max(o.ended_at for o in done))


async def fairness(url: str, cap: float, seconds: float) -> dict:
    t0 = time.monotonic()
    flood, light = await asyncio.gather(closed_loop(url, "flood", 64, seconds, ANSWER, t0),
                                        poisson(url, "light", 0.2 * cap, seconds, t0))
    ramp = 5.0  # the first seconds fill the line
    a = [o for o in flood if o.status == 200 and o.sent_at > ramp]
    b = [o for o in light if o.sent_at > ramp]
    retried = [o for o in flood if o.retried]
    return {"a_ttft": percentile([o.ttft_s for o in a], 0.5) * 1000,
            "b_ttft": percentile([o.ttft_s for o in b if o.status == 200], 0.5) * 1000,
            "b_sent": len(light), "b_refused": sum(o.status != 200 for o in light), "a_served": len(a),
            "a_429": sum(o.retried for o in flood), "a_failed": sum(o.status != 200 for o in flood),
            "retry_ok": (sum(bool(o.first_retry_ok) for o in retried), len(retried))}


async def metered(url: str, seconds: float) -> dict:
    t0 = time.monotonic()
    done = await closed_loop(url, "metered", 2, seconds, 150, t0)
    within = [o for o in done if o.status == 200 and o.ended_at <= seconds]
    tokens = sum(o.tokens for o in within)
    halves = [sum(o.tokens for o in within if (o.ended_at <= seconds / 2) == first) for first in (True, False)]
    return {"tokens": tokens, "per_min": tokens / seconds * 60, "halves": [h / (seconds / 2) * 60 for h in halves],
            "requests": len(within), "refused_429": sum(o.retried for o in done),
            "failed": sum(o.status != 200 for o in done)}


async def infer(session: aiohttp.ClientSession, url: str, t0: float) -> tuple[float, int, float]:
    sent = time.monotonic()
    async with session.post(url + "/infer", json={"inputs": "tell me", "parameters": {
            "max_new_tokens": 16, "timeout": 2}}) as resp:
        await resp.read()
        return sent - t0, resp.status, time.monotonic() - sent


def oracle_refusals(arrivals: list[float], service_s: float, timeout_s: float, servers: int) -> int:
    """Refusals of a replay that knows each request's start: FIFO on `servers`, refusing exactly the requests that
    could not finish within their timeout (a refused one takes no server)."""
    free = [0.0] * servers
    refused = 0
    for at in sorted(arrivals):
        start = max(at, free[0])
        if start + service_s > at + timeout_s:
            refused += 1
            continue
        heapq.heapreplace(free, start + service_s)
    return refused


async def deadlines(url: str, seconds: float, service_s: float) -> dict:
    t0 = time.monotonic()
    rate = 2 * MAX_RUNNING / service_s  # twice what the workers serve
    results = await poisson(url, "", rate, seconds, t0, make=lambda s: infer(s, url, t0))
    ok = [r for r in results if r[1] == 200]
    refused = [r for r in results if r[1] != 200]
    oracle = oracle_refusals([r[0] for r in results], service_s, 2.0, MAX_RUNNING)
    return {"sent": len(results), "served": len(ok), "refused": len(refused),
            "timed_out": sum(r[1] == 504 for r in results), "early": sum(r[1] == 429 for r in results),
            "longest_refused_s": max((r[2] for r in refused), default=0.0),
            "longest_served_s": max((r[2] for r in ok), default=0.0), "oracle": oracle}


async def service_time(url: str, seconds: float = 6.0) -> float:
    """A request's service time at capacity: max_running over the throughput of a closed loop that keeps the
    workers full (Little's law), as the oracle's servers then serve."""
    t0 = time.monotonic()
    count = 0
    async with aiohttp.ClientSession() as session:
        async def client():
            nonlocal count
            while time.monotonic() - t0 < seconds:
                assert (await infer(session, url, t0))[1] == 200
                count += 1
        await asyncio.gather(*(client() for _ in range(MAX_RUNNING)))
    return MAX_RUNNING * (time.monotonic() - t0) / count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["fairness", "tokens", "deadlines"],
                        choices=["fairness", "tokens", "deadlines"])
    parser.add_argument("--seconds", type=float, default=40.0, help="each fairness and deadlines run")
    parser.add_argument("--token-seconds", type=float, default=120.0, help="the tokens run")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-bench-tenants-"))
    workers = [Process(pdserve("worker", "--role", role, "--port", "0", *SIM), "pdserve worker ready:", CPUS)
               for role in ("prefill", "decode")]
    prefill, decode = (w.address for w in workers)
    processes = list(workers)
    try:
        plain = coordinator(tmp, "plain", prefill, decode, None, refuse_early=False)
        processes.append(plain)
        cap = asyncio.run(capacity(plain.address))
        print(f"# bench/tenants.py on {git_describe(REPO)}: capacity {cap:.1f} requests/s of {ANSWER}-token answers "
              f"(max_running {MAX_RUNNING}, decode step {STEP_MS:g} ms)\n", flush=True)
        if "fairness" in args.parts:
            keys = (f"{hash_key(KEYS['flood'])} name=flood concurrency=48\n"
                    f"{hash_key(KEYS['light'])} name=light\n")
            fair = coordinator(tmp, "fair", prefill, decode, keys)
            processes.append(fair)
            rows = {"tenants (fair share)": asyncio.run(fairness(fair.address, cap, args.seconds)),
                    "one line (no tenants)": asyncio.run(fairness(plain.address, cap, args.seconds))}
            print("## Fairness: A floods (64 clients, 48 at most in flight), B sends 20% of capacity\n")
            print("| coordinator | A TTFT p50 ms | B TTFT p50 ms | B / A | B sent | B refused or failed | A served "
                  "| A 429s | A retries admitted at first retry |")
            print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
            for name, r in rows.items():
                ok, total = r["retry_ok"]
                print(f"| {name} | {r['a_ttft']:.0f} | {r['b_ttft']:.0f} | {r['b_ttft'] / r['a_ttft']:.3f}x "
                      f"| {r['b_sent']} | {r['b_refused']} | {r['a_served']} | {r['a_429']} | {ok} of {total} |")
            fair_row = rows["tenants (fair share)"]
            ratio = fair_row["b_ttft"] / fair_row["a_ttft"]
            print(f"\nB's TTFT p50 over A's with tenants: {ratio:.3f}x (target <= 0.25): "
                  f"{'met' if ratio <= 0.25 else 'NOT met'}; B refused or failed: {fair_row['b_refused']} "
                  f"(target 0): {'met' if fair_row['b_refused'] == 0 else 'NOT met'}\n", flush=True)
        if "tokens" in args.parts:
            meter = coordinator(tmp, "metered", prefill, decode, f"{hash_key(KEYS['metered'])} name=metered tpm=1000\n")
            processes.append(meter)
            r = asyncio.run(metered(meter.address, args.token_seconds))
            print(f"## Token limit: tpm=1000, 2 clients streaming 150-token answers for {args.token_seconds:g} s\n")
            print("| tokens served | per minute | first half, per minute | second half, per minute | requests | "
                  "429s (retried) | failed |")
            print("|---:|---:|---:|---:|---:|---:|---:|")
            print(f"| {r['tokens']} | {r['per_min']:.0f} | {r['halves'][0]:.0f} | {r['halves'][1]:.0f} | "
                  f"{r['requests']} | {r['refused_429']} | {r['failed']} |")
            off = r["per_min"] / 1000 - 1
            print(f"\nHeld to {r['per_min']:.0f} tokens/min: {off:+.1%} of the limit (target within 10%): "
                  f"{'met' if abs(off) <= 0.10 else 'NOT met'}\n", flush=True)
        if "deadlines" in args.parts:
            early = coordinator(tmp, "early", prefill, decode, None)
            processes.append(early)
            service = asyncio.run(service_time(early.address))
            rows = {"refuse early": asyncio.run(deadlines(early.address, args.seconds, service)),
                    "wait for the timeout": asyncio.run(deadlines(plain.address, args.seconds, service))}
            print(f"## Deadlines: /infer with timeout 2 s, Poisson at 2x capacity for {args.seconds:g} s "
                  f"(service time at capacity {service * 1000:.0f} ms)\n")
            print("| coordinator | sent | served | refused | of them 504 (timed out) | longest wait of a refused, s "
                  "| longest served, s | oracle's refusals | refused / oracle's |")
            print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
            for name, r in rows.items():
                print(f"| {name} | {r['sent']} | {r['served']} | {r['refused']} | {r['timed_out']} | "
                      f"{r['longest_refused_s']:.2f} | {r['longest_served_s']:.2f} | {r['oracle']} | "
                      f"{r['refused'] / max(1, r['oracle']):.3f}x |")
            r = rows["refuse early"]
            print(f"\nWith early refusal: {r['timed_out']} timed out (target 0): "
                  f"{'met' if r['timed_out'] == 0 else 'NOT met'}; refusals {r['refused'] / max(1, r['oracle']):.3f}x "
                  f"the oracle's (target <= 1.05): {'met' if r['refused'] <= 1.05 * r['oracle'] else 'NOT met'}\n")
    finally:
        for process in reversed(processes):
            process.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
