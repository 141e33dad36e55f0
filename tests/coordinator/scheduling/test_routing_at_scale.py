"""One coordinator in front of 32 simulated prefill and 32 simulated decode workers (real processes):
hundreds of concurrent requests all succeed and every instance takes a share, per routing policy."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest

from tests.helpers import ServerProcess, metrics_url, pdserve_argv, start_coordinator, write_config

pytestmark = pytest.mark.system

NUM_PREFILL = NUM_DECODE = 32
NUM_REQUESTS = 256
MAX_TOKENS = 8
ALGORITHMS = ("round_robin", "load_balance", "cache_affinity")
SERVED = "pdserve_worker_requests_total"
HEALTH_CHECK_S = 0.5
# Quick forwards: the test is about routing, not about the cost model.
SIM_FLAGS = ("--simulate", "--sim-prefill-base-ms", "0.5", "--sim-decode-base-ms", "2")


def parallel(fn, items) -> list:
    with ThreadPoolExecutor(max(1, len(items))) as pool:
        return list(pool.map(fn, items))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    # Compiled modules shared through a temporary cache (the environment may forbid writing them into the
    # tree): the first worker compiles, the other 63 only load, a quarter less start-up CPU each.
    env = {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(tmp_path_factory.mktemp("pycache"))}

    def start(role: str) -> ServerProcess:
        return ServerProcess(pdserve_argv("worker", "--role", role, "--port", "0", *SIM_FLAGS),
                             "pdserve worker ready:", timeout_s=90, env=env)

    roles = ["prefill"] * NUM_PREFILL + ["decode"] * NUM_DECODE
    first = start(roles[0])
    # The rest at once: one by one, 63 interpreter start-ups would take most of a minute.
    workers = [first, *parallel(start, roles[1:])]
    yield workers[:NUM_PREFILL], workers[NUM_PREFILL:]
    assert parallel(lambda w: w.stop(), workers) == [0] * len(workers)


@pytest.fixture(scope="module")
def coordinators(fleet, model_dir, tmp_path_factory) -> dict[str, ServerProcess]:
    """One coordinator per policy in front of the same fleet, started together (each takes seconds)."""
    prefill, decode = fleet

    def start(algorithm: str) -> ServerProcess:
        config = write_config(tmp_path_factory.mktemp(algorithm) / "ms_coordinator.json",
                              [w.address for w in prefill], [w.address for w in decode], model_dir)
        settings = json.loads(config.read_text())
        settings["digs_scheduler_config"] = {"algorithm_type": algorithm}
        settings["health_config"] = {"check_interval_s": HEALTH_CHECK_S}
        config.write_text(json.dumps(settings))
        return start_coordinator(config)

    started = dict(zip(ALGORITHMS, parallel(start, ALGORITHMS)))
    yield started
    assert parallel(lambda c: c.stop(), list(started.values())) == [0] * len(started)


def wait_until_settled(coordinator: ServerProcess, timeout_s: float = 15.0) -> None:
    """Until the coordinator has seen every instance healthy and idle: the three coordinators share the
    fleet, and load one reported during another's test would steer load_balance away from it."""
    manage = next(l for l in coordinator.output if l.startswith("pdserve coordinator management:")).split()[-1]
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"{manage}/v1/instances", timeout=10) as resp:
            instances = [i for role in json.loads(resp.read()).values() for i in role]
        busy = [i["address"] for i in instances if i["state"] != "healthy" or i["outstanding_requests"]
                or any(i["reported"][k] for k in ("num_running", "num_waiting", "kv_used_tokens",
                                                   "queued_prompt_tokens"))]
        if len(instances) == NUM_PREFILL + NUM_DECODE and not busy:
            return
        assert time.monotonic() < deadline, f"instances not idle after {timeout_s}s: {busy}"
        time.sleep(HEALTH_CHECK_S / 2)


def served(workers: list[ServerProcess]) -> list[float]:
    """Each worker's pdserve_worker_requests_total (a plain GET: 64 httpx clients cost seconds of CPU here)."""
    def read(worker: ServerProcess) -> float:
        with urllib.request.urlopen(f"{metrics_url(worker)}/metrics", timeout=10) as resp:
            lines = resp.read().decode().splitlines()
        return next(float(line.split()[1]) for line in lines if line.startswith(SERVED + " "))

    return parallel(read, workers)


async def fire(url: str, prompts: list[str]) -> list[dict]:
    """Every prompt at once, alternately streamed and not; the usage each answer reports."""
    # aiohttp, not httpx: a twentieth of the client CPU here, which shares two cores with 67 servers.
    async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=len(prompts)),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def one(i: int, prompt: str) -> dict:
            body = {"model": "pdserve-tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": i % 2 == 1}
            async with session.post("/v1/completions", json=body) as resp:
                text = await resp.text()
                assert resp.status == 200, text
            if not body["stream"]:
                return json.loads(text)["usage"]
            events = [json.loads(line[6:]) for line in text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            return events[-1]["usage"]

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_instance_serves_a_share_of_concurrent_requests(fleet, coordinators, algorithm):
    prefill, decode = fleet
    coordinator = coordinators[algorithm]
    wait_until_settled(coordinator)
    before_p, before_d = served(prefill), served(decode)
    # Prompts that differ from their first token on, so no two share a cached prefix.
    prompts = [f"{i} bottles of water on the wall, take one down" for i in range(NUM_REQUESTS)]
    usages = asyncio.run(fire(coordinator.address, prompts))
    assert [u["completion_tokens"] for u in usages] == [MAX_TOKENS] * NUM_REQUESTS
    per_prefill = [a - b for a, b in zip(served(prefill), before_p)]
    per_decode = [a - b for a, b in zip(served(decode), before_d)]
    assert sum(per_prefill) == sum(per_decode) == NUM_REQUESTS
    assert min(per_prefill) > 0 and min(per_decode) > 0, (per_prefill, per_decode)
    if algorithm == "round_robin":
        assert set(per_prefill) == {NUM_REQUESTS // NUM_PREFILL} and set(per_decode) == {NUM_REQUESTS // NUM_DECODE}
    if algorithm == "cache_affinity":
        # One long prompt again and again, one at a time: always the prefill instance that has its prefix.
        before = served(prefill)
        for _ in range(5):
            asyncio.run(fire(coordinator.address, [prompts[0] * 4]))
        assert sorted(a - b for a, b in zip(served(prefill), before))[-2:] == [0, 5]
