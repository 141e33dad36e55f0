"""Coordinators on etcd, as processes: a real etcd, real workers (the embedded model), two coordinators.

The workers reach the coordinators' management ports through a FailoverService (what a Kubernetes Service
does), so they register through the first coordinator and heartbeat through whichever lives. The tests run
in order on one set of workers: the active coordinator is killed, then etcd is, then replicas serve.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.coordinator.cluster.service import FailoverService
from tests.helpers import (
    ServerProcess,
    management_url,
    sse_events,
    start_coordinator,
    start_worker,
    wait_for,
    worker_cache_view,
    write_config,
)

pytestmark = pytest.mark.system

COMPLETION = {"model": "pdserve-tiny", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
HEARTBEATS = {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3, "check_interval_s": 1}


class Coordinators:
    """The module's processes: etcd, the management Services, the workers, and the coordinators of the moment."""

    def __init__(self, etcd, model_dir: Path, tmp: Path):
        self.etcd, self.model_dir, self.tmp = etcd, model_dir, tmp
        self.service = FailoverService()  # the workers' --coordinator
        self.late_service = FailoverService()  # the late worker's: no backend until a test opens it
        with ThreadPoolExecutor(3) as pool:
            args = ("--coordinator", self.service.url)
            futures = [pool.submit(start_worker, "prefill", model_dir, *args),
                       pool.submit(start_worker, "decode", model_dir, *args),
                       pool.submit(start_worker, "decode", model_dir, "--coordinator", self.late_service.url)]
            self.prefill, self.decode, self.late = [f.result() for f in futures]
        self.running: dict[str, ServerProcess] = {}

    def config(self, name: str, prefix: str, mode: str, algorithm: str) -> Path:
        return write_config(self.tmp / f"{name}.json", [], [], self.model_dir, sections={
            "health_config": HEARTBEATS, "digs_scheduler_config": {"algorithm_type": algorithm},
            "backup_config": {"etcd_endpoints": [self.etcd.url], "key_prefix": prefix, "mode": mode,
                              "coordinator_name": name}})

    def start(self, prefix: str, mode: str, *names: str, algorithm: str = "round_robin") -> list[ServerProcess]:
        with ThreadPoolExecutor(len(names)) as pool:
            started = list(pool.map(lambda n: start_coordinator(self.config(n, prefix, mode, algorithm)), names))
        self.running.update(zip(names, started))
        return started

    def stop_all(self) -> None:
        with ThreadPoolExecutor(max(1, len(self.running))) as pool:
            list(pool.map(ServerProcess.stop, self.running.values()))
        self.running.clear()

    def close(self) -> None:
        self.stop_all()
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(ServerProcess.stop, (self.prefill, self.decode, self.late)))
        self.service.close()
        self.late_service.close()


@pytest.fixture(scope="module")
def coordinators(etcd, model_dir, tmp_path_factory):
    processes = Coordinators(etcd, model_dir, tmp_path_factory.mktemp("coordinators"))
    yield processes
    processes.close()


def host_port(url: str) -> str:
    return url.split("://", 1)[1]


def health(url: str) -> tuple[int, dict]:
    resp = httpx.get(f"{url}/health", timeout=10)
    return resp.status_code, resp.json()


def listed(coordinator: ServerProcess) -> dict[str, dict[str, dict]]:
    body = httpx.get(f"{management_url(coordinator)}/v1/instances", timeout=10).json()
    return {role: {i["address"]: i for i in group} for role, group in body.items()}


def lists(coordinator: ServerProcess, *workers: ServerProcess) -> bool:
    instances = listed(coordinator)
    return all(any(w.address in group for group in instances.values()) for w in workers)


def heartbeats(coordinator: ServerProcess, *workers: ServerProcess) -> list[int]:
    """The heartbeats `coordinator` has accepted from each of `workers` (0 for one it does not list)."""
    instances = listed(coordinator)
    return [next((group[w.address]["heartbeats"] for group in instances.values() if w.address in group), 0)
            for w in workers]


# Heartbeats that take longer than the worker leases' TTL (heartbeat_timeout_s; the leader key's lease_ttl_s is the
# same 3 s) at heartbeat_interval_s apart, with a health check round to spare: once a coordinator has accepted this
# many more from each worker, any lease that nothing kept alive has expired and been noticed.
HEARTBEATS_PAST_THE_LEASES = int((HEARTBEATS["heartbeat_timeout_s"] + HEARTBEATS["check_interval_s"])
                                 / HEARTBEATS["heartbeat_interval_s"]) + 2


def wait_for_heartbeats_past_the_leases(coordinator: ServerProcess, *workers: ServerProcess) -> None:
    start = heartbeats(coordinator, *workers)
    wait_for(lambda: all(now >= was + HEARTBEATS_PAST_THE_LEASES
                         for was, now in zip(start, heartbeats(coordinator, *workers))), 60,
             f"{HEARTBEATS_PAST_THE_LEASES} more heartbeats from each worker")


def post_until_served(urls: list[str], path: str, body: dict, deadline: float) -> httpx.Response:
    """A client behind a Service: the first coordinator that accepts the connection; a 503 with Retry-After
    (a standby) waits that long and tries again."""
    while True:
        wait = 0.05  # every coordinator refused the connection
        for url in urls:
            try:
                resp = httpx.post(f"{url}{path}", json=body, timeout=30)
            except httpx.TransportError:  # refused, or reset by a coordinator that is dying
                continue
            if resp.status_code != 503 or "Retry-After" not in resp.headers:
                return resp
            wait = float(resp.headers["Retry-After"])
            break
        if time.monotonic() + wait > deadline:
            raise AssertionError(f"not served by {deadline:.1f}")
        time.sleep(wait)


def test_a_standby_takes_over_within_5s_of_the_active_being_killed(coordinators):
    first, second = coordinators.start("/failover", "active_standby", "A", "B")
    roles = {c: health(c.address)[1]["role"] for c in (first, second)}
    assert sorted(roles.values()) == ["active", "standby"], roles
    (active, leader), (standby, _) = sorted(((first, "A"), (second, "B")), key=lambda c: roles[c[0]])
    coordinators.service.backends = [host_port(management_url(c)) for c in (active, standby)]
    workers = (coordinators.prefill, coordinators.decode)
    wait_for(lambda: lists(active, *workers) and lists(standby, *workers), 15, "both coordinators list the workers")

    # The standby: 503 with Retry-After on every client API (each in its own error body), alive, not ready.
    status, body = health(standby.address)
    assert (status, body["role"], body["leader"]) == (503, "standby", leader)
    refused = httpx.post(f"{standby.address}/v1/completions", json=COMPLETION, timeout=10)
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["type"] == "service_unavailable"
    tgi = httpx.post(f"{standby.address}/generate", json={"inputs": "Hi"}, timeout=10)
    assert tgi.status_code == 503 and tgi.json()["error_type"] == "service_unavailable"
    for url in (standby.address, management_url(standby)):
        assert httpx.get(f"{url}/health/live", timeout=10).json() == {"status": "alive"}
    assert httpx.get(f"{management_url(standby)}/v1/instances", timeout=10).status_code == 200
    assert httpx.post(f"{active.address}/v1/completions", json=COMPLETION, timeout=30).status_code == 200

    active.proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    active.proc.wait()
    urls = [active.address, standby.address]
    served = post_until_served(urls, "/v1/completions", COMPLETION, killed_at + 10)
    took = time.monotonic() - killed_at
    assert served.status_code == 200, served.text
    assert took < 5, f"the standby took over {took:.1f}s after the kill"
    stream = post_until_served(urls, "/v1/completions", {**COMPLETION, "stream": True}, killed_at + 10)
    assert stream.status_code == 200 and sse_events(stream.content)[-1] == "[DONE]"
    assert health(standby.address)[1]["role"] == "active"
    # The registry survived the active: both workers, heartbeating through the Service to the new active, for
    # longer than their etcd leases would have lasted without it.
    wait_for_heartbeats_past_the_leases(standby, coordinators.prefill, coordinators.decode)
    instances = listed(standby)
    assert instances["prefill"][coordinators.prefill.address]["state"] == "healthy"
    assert instances["decode"][coordinators.decode.address]["state"] == "healthy"
    coordinators.running = {"survivor": standby}


def test_requests_go_on_through_an_etcd_outage_and_the_registry_resyncs_after(coordinators):
    active = coordinators.running["survivor"]
    (standby,) = coordinators.start("/failover", "active_standby", "A2")
    workers = (coordinators.prefill, coordinators.decode)
    wait_for(lambda: lists(standby, *workers), 15, "the new standby lists the workers")
    assert health(standby.address)[1]["role"] == "standby"

    coordinators.etcd.kill()
    coordinators.late_service.backends = [host_port(management_url(standby))]
    for coordinator in (active, standby):
        wait_for(lambda: health(coordinator.address)[1]["etcd"]["reachable"] is False, 30,
                 "the coordinator to see etcd gone")
    # Requests are served throughout an outage longer than the worker and leader leases (counted in the workers'
    # heartbeats to the active).
    start, deadline = heartbeats(active, *workers), time.monotonic() + 60
    while not all(now >= was + HEARTBEATS_PAST_THE_LEASES for was, now in zip(start, heartbeats(active, *workers))):
        assert time.monotonic() < deadline, f"not {HEARTBEATS_PAST_THE_LEASES} more heartbeats within 60 s"
        resp = httpx.post(f"{active.address}/v1/completions", json=COMPLETION, timeout=30)
        assert resp.status_code == 200, resp.text
        time.sleep(0.25)
    for url in (active.address, management_url(active)):
        status, body = health(url)
        assert status == 200 and body["role"] == "active"
        assert body["etcd"]["reachable"] is False and body["etcd"]["since"] and body["etcd"]["error"]
    assert health(standby.address)[1]["etcd"]["reachable"] is False
    # A worker registers through the standby during the outage: only the standby knows it for now.
    wait_for(lambda: lists(standby, coordinators.late), 15, "the late worker registers through the standby")
    assert not lists(active, coordinators.late)
    assert lists(active, *workers), "the active dropped workers because etcd is down"

    coordinators.etcd.start()
    wait_for(lambda: lists(active, coordinators.late), 10, "the active learns the late worker after etcd returns")
    status, body = health(active.address)
    assert body["etcd"]["reachable"] is True and body["role"] == "active"
    assert health(standby.address)[1]["role"] == "standby"
    assert httpx.post(f"{active.address}/v1/completions", json=COMPLETION, timeout=30).status_code == 200
    assert lists(active, *workers, coordinators.late) and lists(standby, *workers, coordinators.late)


def test_replicas_route_to_workers_registered_through_another(coordinators):
    coordinators.stop_all()
    first, second = coordinators.start("/replicas", "replicas", "R1", "R2", algorithm="cache_affinity")
    coordinators.service.backends = [host_port(management_url(first))]
    coordinators.late_service.backends = [host_port(management_url(first))]
    workers = (coordinators.prefill, coordinators.decode, coordinators.late)
    wait_for(lambda: lists(first, *workers), 15, "the workers register again through the first replica")
    wait_for(lambda: lists(second, *workers), 10, "the second replica learns them from etcd")
    assert health(second.address)[0] == 200 and health(second.address)[1]["role"] == "replica"

    for prompt in ("Hello there", "The coordinator sends the prompt", "1 2 3 4 5"):
        resp = httpx.post(f"{second.address}/v1/completions", json={**COMPLETION, "prompt": prompt}, timeout=30)
        assert resp.status_code == 200, resp.text
    stream = httpx.post(f"{second.address}/v1/chat/completions", timeout=30, json={
        "model": "pdserve-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True})
    assert stream.status_code == 200 and sse_events(stream.content)[-1] == "[DONE]"
    instances = listed(second)
    assert instances["prefill"][coordinators.prefill.address]["served"] >= 4
    assert sum(instances["decode"][w.address]["served"] for w in (coordinators.decode, coordinators.late)) >= 4
    assert all(i["source"] == "registered" for group in instances.values() for i in group.values())


def test_replicas_each_follow_every_worker_into_the_same_kv_index(coordinators):
    """No index state goes through etcd: each replica subscribes to every worker's KV events itself."""
    first, second = coordinators.running["R1"], coordinators.running["R2"]
    workers = (coordinators.prefill, coordinators.decode, coordinators.late)

    def indexes_agree():
        views = {w.address: worker_cache_view(w.address) for w in workers}
        held = [{i["address"]: i["kv_index"] for group in httpx.get(f"{management_url(c)}/v1/instances",
                                                                    timeout=10).json().values() for i in group}
                for c in (first, second)]
        return all(h.get(a) is not None and all(h[a][k] == v[k] for k in ("blocks", "digest", "epoch"))
                   for h in held for a, v in views.items()) and views

    views = wait_for(indexes_agree, 10, "both replicas' indexes to match every worker's cache")
    assert views[coordinators.prefill.address]["blocks"] > 0
