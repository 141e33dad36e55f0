"""Mixed versions: release N-1 (PREVIOUS_RELEASE, a git worktree) and release N (this tree) in one cluster.

A rolling upgrade under continuous greedy streaming load, worker by worker (decode-1, prefill-1, prefill-2,
decode-2), then the coordinator, with every mixed pairing shown to have served requests (N-1 prefill -> N decode,
N prefill -> N-1 decode, N-1 coordinator -> N workers, N coordinator -> workers it learnt from etcd); the same as
a rollback (N to N-1); and two coordinator replicas of either release over the same workers. Nothing may fail,
every text must equal the undisturbed one, no worker may keep KV, and every replaced process must drain and exit 0
by itself.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from tests.etcd_server import EtcdServer
from tests.helpers import (
    ServerProcess,
    free_port,
    index_matches_workers,
    management_url,
    metrics_url,
    scrape,
    sse_events,
    wait_for,
    wait_for_idle,
    write_config,
)
from tests.upgrade.previous_release import (
    CURRENT,
    PREVIOUS_RELEASE,
    PreviousReleaseMissing,
    Release,
    add_previous_release,
    git,
    remove,
)

pytestmark = pytest.mark.system

PROMPTS = [
    "Hello there",
    "The coordinator sends the prompt",
    "Once upon a time there was a little server that served tokens.",
    "1 2 3 4 5",
    "A rolling upgrade replaces one worker at a time",
    "def fibonacci(n):",
    "The quick brown fox jumps over the lazy dog",
    "Prefill builds the KV cache; decode generates",
]
MAX_TOKENS = 24
LOAD_THREADS = 2  # continuous: each thread sends its next stream as the last ends
DRAIN_S = 20.0  # workers' --drain-seconds and the coordinators' http_config.drain_seconds
EXIT_MARGIN_S = 30.0  # past the drain budget, for a loaded machine
WAIT_S = 60.0  # any wait on state
# Heartbeats every 0.5 s, a worker's registration lease (in etcd too) 5 s; the silence watch as generous as the
# shared clusters' (tests/conftest.py), since 3 test processes and their clusters share few cores.
HEALTH = {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5, "check_interval_s": 1,
          "silence_timeout_s": 10.0, "silence_probe_timeout_s": 10.0}
# What release N adds that crosses the wire, switched on in N's processes so that the mixed pairings carry it: the
# coordinator's draft corpus (DecodeRequest.draft_hints) and drafting decode workers. Each release reviews it.
N_WORKER_ARGS = {"decode": ("--speculative-method", "suffix")}
N_COORDINATOR_SECTIONS = {"speculative_config": {"enabled": True}}
HEARTBEATS_PAST_THE_LEASE = int((HEALTH["heartbeat_timeout_s"] + HEALTH["check_interval_s"])
                                / HEALTH["heartbeat_interval_s"]) + 2


@pytest.fixture(scope="session")
def n_minus_1(tmp_path_factory) -> Release:
    """Release N-1 checked out beside this tree for the session (one worktree per pytest-xdist worker)."""
    try:
        release = add_previous_release(tmp_path_factory.mktemp("previous_release"))
    except PreviousReleaseMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    yield release
    remove(release.tree)


# --- the cluster ---------------------------------------------------------------------------------------------------


class Fleet:
    """One test's processes: etcd, coordinators on management ports chosen up front (every worker is told all of
    them, `--coordinator A,B`, and heartbeats through the first that answers), and workers; `close` stops what
    still runs."""

    def __init__(self, tmp: Path, model_dir: Path, stack: ExitStack, coordinators: int = 2):
        self.tmp, self.model_dir = tmp, model_dir
        self.etcd = EtcdServer(tmp / "etcd").start()
        stack.callback(self.etcd.stop)
        self.manage_ports = [free_port() for _ in range(coordinators)]
        self.processes: list[ServerProcess] = []
        stack.callback(self.close)

    @property
    def coordinator_urls(self) -> str:
        return ",".join(f"http://127.0.0.1:{port}" for port in self.manage_ports)

    def coordinator(self, release: Release, index: int, algorithm: str = "round_robin") -> ServerProcess:
        name = f"{release.name}-{index}"
        config = write_config(self.tmp / f"coordinator-{name}.json", [], [], self.model_dir, sections={
            "http_config": {"predict_ip": "127.0.0.1", "predict_port": 0, "manage_port": self.manage_ports[index],
                            "drain_seconds": DRAIN_S},
            "health_config": HEALTH, "digs_scheduler_config": {"algorithm_type": algorithm},
            "backup_config": {"etcd_endpoints": [self.etcd.url], "key_prefix": "/upgrade", "mode": "replicas",
                              "coordinator_name": name},
            **(N_COORDINATOR_SECTIONS if release is CURRENT else {})}, maxIterTimes=MAX_TOKENS * 2)
        return self._started(release.coordinator(config))

    def workers(self, release: Release, *roles: str) -> list[ServerProcess]:
        args = ("--coordinator", self.coordinator_urls, "--heartbeat-interval", str(HEALTH["heartbeat_interval_s"]),
                "--drain-seconds", str(DRAIN_S), "--kv-trans-timeout", "15")
        with ThreadPoolExecutor(len(roles)) as pool:
            futures = [pool.submit(release.worker, role, self.model_dir, *args,
                                   *(N_WORKER_ARGS.get(role, ()) if release is CURRENT else ()))
                       for role in roles]
            return [self._started(f.result()) for f in futures]

    def cluster(self, release: Release) -> tuple[ServerProcess, list[ServerProcess], list[ServerProcess]]:
        """A coordinator (the first management port), 2 prefill and 2 decode workers of `release`, started at once
        (a worker registers once the coordinator listens), and routable."""
        with ThreadPoolExecutor(3) as pool:
            started = (pool.submit(self.coordinator, release, 0),
                       pool.submit(self.workers, release, "prefill", "prefill"),
                       pool.submit(self.workers, release, "decode", "decode"))
            coordinator, prefill, decode = (f.result() for f in started)
        wait_routable(coordinator, prefill, decode)
        return coordinator, prefill, decode

    def _started(self, process: ServerProcess) -> ServerProcess:
        self.processes.append(process)
        return process

    def close(self) -> None:
        with ThreadPoolExecutor(max(1, len(self.processes))) as pool:
            list(pool.map(ServerProcess.stop, self.processes))


def listed(coordinator: ServerProcess) -> dict[str, dict[str, dict]]:
    """role -> address -> the instance as the coordinator's management API describes it."""
    body = httpx.get(f"{management_url(coordinator)}/v1/instances", timeout=10).json()
    return {role: {i["address"]: i for i in group} for role, group in body.items()}


def routes_to(coordinator: ServerProcess, prefill: list[ServerProcess], decode: list[ServerProcess]) -> bool:
    """The coordinator lists exactly these workers, each healthy (routable)."""
    instances = listed(coordinator)
    return all(set(instances.get(role, {})) == {w.address for w in workers}
               and all(i["state"] == "healthy" for i in instances[role].values())
               for role, workers in (("prefill", prefill), ("decode", decode)))


def wait_routable(coordinator: ServerProcess, prefill: list[ServerProcess], decode: list[ServerProcess]) -> None:
    wait_for(lambda: routes_to(coordinator, prefill, decode), WAIT_S,
             f"{coordinator.address} to route to exactly {[w.address for w in prefill + decode]}")


def requests_admitted(worker: ServerProcess) -> float:
    """pdserve_worker_requests_total (both releases have it): requests the worker gave KV budget to."""
    return scrape(metrics_url(worker)).get(("pdserve_worker_requests_total", ()), 0.0)


def wait_admits(worker: ServerProcess, more: int, what: str) -> None:
    """Wait until `worker` has admitted `more` requests beyond what it has now."""
    start = requests_admitted(worker)
    wait_for(lambda: requests_admitted(worker) >= start + more, WAIT_S, f"{what}: {more} requests on {worker.address}")


def exits_by_itself(process: ServerProcess, budget_s: float = DRAIN_S + EXIT_MARGIN_S) -> int | None:
    """SIGTERM, then the process's own exit code within its drain budget (None past it: no kill here)."""
    process.proc.send_signal(signal.SIGTERM)
    try:
        return process.proc.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:  # a forked process's wait raises it too
        return None


def n_sees_the_replica(coordinator: ServerProcess, name: str) -> dict | None:
    """The coordinator's active wire formats and the ranges it takes replica `name` to read (None until it knows
    of it)."""
    formats = httpx.get(f"{management_url(coordinator)}/v1/cluster/formats", timeout=10).json()
    replica = next((p for p in formats["processes"] if p["process"] == f"coordinator {name}"), None)
    return replica and {"active": formats["active"], "replica": replica["formats"]}


# --- the load ------------------------------------------------------------------------------------------------------


def stream_text(client: httpx.Client, url: str, prompt: str) -> str:
    """A greedy streaming /v1/completions, its text joined from the SSE chunks; raises on anything but a whole,
    error-free stream."""
    resp = client.post(f"{url}/v1/completions", json={
        "model": "pdserve-tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "stream": True})
    if resp.status_code != 200:
        raise AssertionError(f"HTTP {resp.status_code}: {resp.text[:500]}")
    events = sse_events(resp.content)
    if events[-1] != "[DONE]":
        raise AssertionError(f"no [DONE]: {events[-3:]}")
    chunks = [json.loads(e) for e in events[:-1]]
    errors = [c for c in chunks if "error" in c]
    if errors:
        raise AssertionError(f"an error event: {errors[0]}")
    if chunks[-1]["choices"][0].get("finish_reason") != "length":
        raise AssertionError(f"ended with {chunks[-1]}")
    return "".join(c["choices"][0]["text"] for c in chunks)


def reference_texts(url: str) -> dict[str, str]:
    with httpx.Client(timeout=60) as client:
        return {prompt: stream_text(client, url, prompt) for prompt in PROMPTS}


class StreamingLoad:
    """Client threads looping greedy streaming completions over PROMPTS, each request to the coordinator of the
    moment (`url`); every failure and every text unlike the reference is kept."""

    def __init__(self, url: str, references: dict[str, str], threads: int = LOAD_THREADS):
        self.url = url
        self.references = references
        self.served: dict[str, int] = {}  # coordinator URL -> requests served well through it
        self.failures: list[str] = []
        self.mismatches: list[str] = []
        self.sending_to: list[str | None] = [None] * threads  # the URL each thread's latest request went to
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def _loop(self, index: int) -> None:
        with httpx.Client(timeout=60) as client:
            n = index
            while not self._stop.is_set():
                prompt, n = PROMPTS[n % len(PROMPTS)], n + 1
                url = self.url
                self.sending_to[index] = url
                try:
                    text = stream_text(client, url, prompt)
                except Exception as exc:  # noqa: BLE001: every failure is the test's finding
                    with self._lock:
                        self.failures.append(f"{prompt!r} via {url}: {exc!r}")
                    continue
                with self._lock:
                    if text != self.references[prompt]:
                        self.mismatches.append(f"{prompt!r} via {url}: {text!r} != {self.references[prompt]!r}")
                    self.served[url] = self.served.get(url, 0) + 1

    def switch_to(self, url: str) -> None:
        """Send every thread's next request to `url`; returns once each has started one there (none goes to the
        coordinator before any more)."""
        self.url = url
        wait_for(lambda: all(u == url for u in self.sending_to), WAIT_S, f"every load thread to send to {url}")

    def stop(self) -> int:
        """Stop every thread after its request; returns how many still hang."""
        self._stop.set()
        for thread in self._threads:
            thread.join(90)
        return sum(t.is_alive() for t in self._threads)


# --- the tests -----------------------------------------------------------------------------------------------------


@pytest.mark.long
@pytest.mark.parametrize("direction", ["upgrade", "rollback"])
def test_a_rolling_upgrade_under_streaming_load_fails_nothing_and_changes_no_text(
        direction, n_minus_1, model_dir, tmp_path):
    """upgrade: an N-1 cluster becomes N; rollback: an N cluster becomes N-1. Workers one at a time (decode-1,
    prefill-1, prefill-2, decode-2) under the old coordinator, then the coordinator."""
    old, new = (n_minus_1, CURRENT) if direction == "upgrade" else (CURRENT, n_minus_1)
    began, timeline = time.monotonic(), []  # (seconds since the start, what was done): printed, for slow runs

    def done(what: str) -> None:
        timeline.append((round(time.monotonic() - began, 1), what))

    with ExitStack() as stack:
        fleet = Fleet(tmp_path, model_dir, stack)
        old_coordinator, prefill, decode = fleet.cluster(old)

        references = reference_texts(old_coordinator.address)  # undisturbed
        load = StreamingLoad(old_coordinator.address, references)
        stack.callback(load.stop)
        stack.callback(lambda: print(f"{direction}: {timeline}; served {load.served}, failed {load.failures[:5]}, "
                                     f"unlike the reference {load.mismatches[:5]}"))  # shown when the test fails
        wait_for(lambda: sum(load.served.values()) >= LOAD_THREADS, WAIT_S, "the load to be served")
        done(f"{old.name} cluster up, references taken, load on")

        def replace(workers: list[ServerProcess], index: int, role: str) -> ServerProcess:
            """Start the new release's worker, wait until it is routable, then SIGTERM the old one and wait for its
            own exit."""
            (started,) = fleet.workers(new, role)
            retired, workers[index] = workers[index], started
            wait_for(lambda: listed(old_coordinator)[role].get(started.address, {}).get("state") == "healthy",
                     WAIT_S, f"the {new.name} {role} worker to be routable")
            code = exits_by_itself(retired)
            assert code == 0, f"the {old.name} {role}-{index + 1} worker: {code}\n{''.join(retired.output)[-3000:]}"
            done(f"{role}-{index + 1} replaced")
            return started

        # old prefill -> new decode: the new decode-1 admits requests while both prefill workers are old.
        new_decode = replace(decode, 0, "decode")
        wait_admits(new_decode, 3, f"{old.name} prefill -> {new.name} decode")
        # Both kinds of prefill worker, each to decode workers of both releases.
        new_prefill = replace(prefill, 0, "prefill")
        wait_admits(new_prefill, 3, f"{new.name} prefill beside an {old.name} one")
        replace(prefill, 1, "prefill")
        # new prefill -> old decode: only new prefill workers are left, and decode-2 is still old.
        wait_admits(decode[1], 3, f"{new.name} prefill -> {old.name} decode")
        wait_admits(replace(decode, 1, "decode"), 3, f"{old.name} coordinator -> {new.name} workers only")

        # The coordinator: the new one learns the workers from etcd, takes the load, and the old one drains.
        new_coordinator = fleet.coordinator(new, 1)
        wait_routable(new_coordinator, prefill, decode)
        load.switch_to(new_coordinator.address)
        code = exits_by_itself(old_coordinator)
        assert code == 0, f"the {old.name} coordinator: {code}\n{''.join(old_coordinator.output)[-3000:]}"
        # The workers heartbeat through the new coordinator now (their registrations outlive their leases), and it
        # routes to every one of them.
        start = {a: i["heartbeats"] for g in listed(new_coordinator).values() for a, i in g.items()}
        wait_for(lambda: all(i["heartbeats"] >= start[a] + HEARTBEATS_PAST_THE_LEASE
                             for g in listed(new_coordinator).values() for a, i in g.items()), WAIT_S,
                 "the workers' heartbeats through the new coordinator past their leases")
        for worker in prefill + decode:
            wait_admits(worker, 2, f"{new.name} coordinator -> {worker.address}")
        assert routes_to(new_coordinator, prefill, decode)
        done("coordinator replaced, its routes shown")

        assert load.stop() == 0, "a load thread hangs"
        assert load.failures == [], f"{len(load.failures)} failed requests: {load.failures[:5]}"
        assert load.mismatches == [], f"{len(load.mismatches)} texts unlike the reference: {load.mismatches[:5]}"
        assert load.served.get(new_coordinator.address, 0) > 0
        for worker, role in [(w, "prefill") for w in prefill] + [(w, "decode") for w in decode]:
            wait_for_idle(worker.address, role, timeout_s=30)  # no KV stranded


def test_coordinator_replicas_of_both_releases_serve_the_same_workers_alike(n_minus_1, model_dir, tmp_path):
    """An N-1 and an N coordinator on one etcd (replicas), over N workers: both list the same instances, both
    follow the workers' KV events into the same index, and the same requests give the same texts (twice through
    each, so that the N coordinator's draft corpus holds every answer the second time)."""
    with ExitStack() as stack:
        fleet = Fleet(tmp_path, model_dir, stack)
        with ThreadPoolExecutor(2) as pool:
            started = [pool.submit(fleet.coordinator, release, i, "cache_affinity")
                       for i, release in enumerate((n_minus_1, CURRENT))]
            coordinators = [f.result() for f in started]
        prefill = fleet.workers(CURRENT, "prefill", "prefill")
        decode = fleet.workers(CURRENT, "decode", "decode")
        for coordinator in coordinators:
            wait_routable(coordinator, prefill, decode)

        texts = [reference_texts(c.address) for _ in range(2) for c in coordinators]
        assert all(t == texts[0] for t in texts), texts
        with httpx.Client(timeout=60) as client:
            chats = [client.post(f"{c.address}/v1/chat/completions", json={
                "model": "pdserve-tiny", "messages": [{"role": "user", "content": p}], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}) for c in coordinators for p in PROMPTS[:3]]
        assert all(r.status_code == 200 for r in chats), [r.text for r in chats if r.status_code != 200]
        contents = [r.json()["choices"][0]["message"]["content"] for r in chats]
        assert contents[:3] == contents[3:]

        def instances(coordinator):
            return {role: {a: (i["state"], i["source"]) for a, i in group.items()}
                    for role, group in listed(coordinator).items()}
        assert instances(coordinators[0]) == instances(coordinators[1])
        # The N coordinator counts the N-1 one among the cluster's processes, and writes no wire format newer than
        # what that one reads (proto/wire_versions.py).
        formats = wait_for(lambda: n_sees_the_replica(coordinators[1], f"{n_minus_1.name}-0"), WAIT_S,
                           "the N coordinator to count the N-1 replica's wire formats")
        assert all(formats["active"][name] <= newest for name, (_, newest) in formats["replica"].items()), formats
        for coordinator in coordinators:  # each routed its own requests (a decode instance counts each once)
            assert sum(i["served"] for i in listed(coordinator)["decode"].values()) >= 2 * len(PROMPTS) + 3
        workers = prefill + decode
        for coordinator in coordinators:
            wait_for(lambda: index_matches_workers(coordinator, workers), WAIT_S,
                     f"{coordinator.address}'s KV index to match every worker's cache")
        for worker, role in [(w, "prefill") for w in prefill] + [(w, "decode") for w in decode]:
            wait_for_idle(worker.address, role, timeout_s=30)


def test_the_previous_release_is_the_one_the_wire_versions_name():
    """PREVIOUS_RELEASE (a commit) and proto/wire_versions.py's PREVIOUS_RELEASE (a release number) move together."""
    from proto import wire_versions

    shown = git("show", f"{PREVIOUS_RELEASE}:pyproject.toml")
    assert shown.returncode == 0, shown.stderr
    assert tomllib.loads(shown.stdout)["project"]["version"] == wire_versions.PREVIOUS_RELEASE
