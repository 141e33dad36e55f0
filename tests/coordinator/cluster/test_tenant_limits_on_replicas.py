"""A tenant's limits across coordinator replicas on a real etcd: each takes 1/N, and a replica that leaves gives
its share back to the others."""

from __future__ import annotations

import httpx
import pytest

from security.api_keys import hash_key
from tests.helpers import start_coordinator, start_sim_worker, wait_for, write_config

pytestmark = pytest.mark.system

KEY = "sk-replicated-tenant-77"


def replicas(url: str) -> int | None:
    return httpx.get(f"{url}/health", timeout=10).json().get("replicas")


def admitted_of(url: str, tries: int) -> tuple[int, list[str]]:
    """How many of `tries` back-to-back requests were admitted, and the 429s' messages."""
    ok, refusals = 0, []
    for _ in range(tries):
        resp = httpx.post(f"{url}/v1/completions", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "pdserve-tiny", "prompt": "hi", "max_tokens": 1})
        if resp.status_code == 200:
            ok += 1
        else:
            assert resp.status_code == 429, resp.text
            refusals.append(resp.json()["error"]["message"])
    return ok, refusals


def test_replicas_divide_a_tenants_rpm_and_one_leaving_gives_its_share_back(etcd, model_dir, tmp_path):
    # 6 requests a minute with a 60 s burst: 6 at once in all, 3 per replica while there are two.
    (tmp_path / "keys").write_text(f"{hash_key(KEY)} name=shared rpm=6\n")
    workers = [start_sim_worker("prefill"), start_sim_worker("decode")]
    sections = {"auth_config": {"api_keys_file": "keys"}, "tenancy_config": {"burst_s": 60},
                "health_config": {"check_interval_s": 1},
                "backup_config": {"etcd_endpoints": [etcd.url], "key_prefix": "/tenants", "mode": "replicas",
                                  "sync_interval_s": 0.2, "lease_ttl_s": 2}}
    coordinators = [start_coordinator(write_config(tmp_path / f"c{i}.json", [workers[0].address],
                                                   [workers[1].address], model_dir,
                                                   sections={**sections, "backup_config": {
                                                       **sections["backup_config"], "coordinator_name": f"c{i}"}}))
                    for i in range(2)]
    try:
        for c in coordinators:
            wait_for(lambda c=c: replicas(c.address) == 2, what="both replicas counted")
        results = [admitted_of(c.address, 5) for c in coordinators]
        assert [ok for ok, _ in results] == [3, 3]  # 6 in all: the tenant's burst, split between the two
        assert all("(this coordinator's 1/2 share)" in m for _, refusals in results for m in refusals)
        assert coordinators[1].stop() == 0  # it leaves: its lease is revoked
        survivor = coordinators[0].address
        wait_for(lambda: replicas(survivor) == 1, what="the survivor counting itself alone")
        ok, refusals = admitted_of(survivor, 5)
        # Its bucket keeps its fill ratio (empty) and now refills at the whole rate: 1 request in 10 s, not 20 s.
        assert refusals and all("1/2 share" not in m and "6 requests per minute" in m for m in refusals), refusals
        assert all(int(m.rsplit("retry after ", 1)[1].rstrip("s")) <= 10 for m in refusals)  # 1/2's would be 20 s
    finally:
        for process in [*coordinators, *workers]:
            process.stop()
