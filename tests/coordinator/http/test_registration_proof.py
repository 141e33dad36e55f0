"""Only real workers join: registration needs the token (no mutual TLS on the management port), and a worker may
heartbeat and deregister only itself."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import ServerProcess, management_url, pdserve_argv, start_coordinator, wait_for, write_config

pytestmark = pytest.mark.system

TOKEN = "registration-token-for-tests-0123456789"


@pytest.fixture(scope="module")
def guarded(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("registration")
    token = tmp / "token"
    token.write_text(TOKEN + "\n")
    config = write_config(tmp / "ms_coordinator.json", [], [], model_dir,
                          {"auth_config": {"registration_token_file": str(token)}})
    coordinator = start_coordinator(config)
    manage = management_url(coordinator)
    workers = [ServerProcess(pdserve_argv("worker", "--role", role, "--port", "0", "--simulate", "--coordinator",
                                          manage, "--registration-token-file", str(token),
                                          "--heartbeat-interval", "0.3"), "pdserve worker ready:", timeout_s=30)
               for role in ("prefill", "decode")]
    yield coordinator, manage, workers
    for proc in (*workers, coordinator):
        proc.stop()


def instances(manage: str, token: str | None = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(f"{manage}/v1/instances", headers=headers, timeout=10)


def test_workers_with_the_token_join_and_serve(guarded):
    coordinator, manage, workers = guarded
    wait_for(lambda: all(len(group) == 1 for group in instances(manage).json().values()), what="both registered")
    resp = httpx.post(coordinator.address + "/v1/completions",
                      json={"model": "pdserve-tiny", "prompt": "hello", "max_tokens": 4}, timeout=30)
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("token", [None, "wrong-token-wrong-token-wrong"])
def test_a_registration_without_proof_is_a_401_and_nothing_joins(guarded, token):
    _, manage, _ = guarded
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    resp = httpx.post(f"{manage}/v1/instances/register", json={"role": "decode", "address": "10.9.9.9:1"},
                      headers=headers, timeout=10)
    assert resp.status_code == 401 and resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert "registration_token_file" in resp.json()["error"]["message"]
    assert "10.9.9.9:1" not in instances(manage).json()["decode"].__repr__()
    assert instances(manage, token=None).status_code == 401  # the instance list needs the proof too


def test_a_heartbeat_or_deregistration_for_another_worker_is_a_403(guarded):
    _, manage, workers = guarded
    wait_for(lambda: len(instances(manage).json()["decode"]) == 1, what="the decode worker registered")
    address = instances(manage).json()["decode"][0]["address"]
    auth = {"Authorization": f"Bearer {TOKEN}"}  # a member of the cluster, but not that worker
    for action in ("heartbeat", "deregister"):
        for credential in ({}, {"X-Pdserve-Credential": "not-its-credential"}):
            resp = httpx.post(f"{manage}/v1/instances/{action}", json={"role": "decode", "address": address},
                              headers={**auth, **credential}, timeout=10)
            assert resp.status_code == 403 and "only itself" in resp.json()["error"]["message"]
    assert [i["address"] for i in instances(manage).json()["decode"]] == [address]
    assert instances(manage).json()["decode"][0]["state"] == "healthy"


def test_another_member_cannot_take_over_a_heartbeating_workers_address(guarded):
    _, manage, _ = guarded
    wait_for(lambda: len(instances(manage).json()["decode"]) == 1, what="the decode worker registered")
    address = instances(manage).json()["decode"][0]["address"]
    resp = httpx.post(f"{manage}/v1/instances/register", json={"role": "decode", "address": address},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert resp.status_code == 409 and "heartbeating" in resp.json()["error"]["message"]
    # The genuine worker's heartbeats still count: two more are accepted after the refusal, and it stays healthy.
    heartbeats = instances(manage).json()["decode"][0]["heartbeats"]
    after = wait_for(lambda: (i := instances(manage).json()["decode"][0])["heartbeats"] >= heartbeats + 2 and i, 30,
                     "two more heartbeats from the genuine worker")
    assert (after["address"], after["state"]) == (address, "healthy")


def test_undecodable_credential_bytes_are_a_4xx_not_a_500(guarded):
    _, manage, _ = guarded
    resp = httpx.post(f"{manage}/v1/instances/heartbeat", json={"role": "decode", "address": "127.0.0.1:1"},
                      headers={"X-Pdserve-Credential": b"\xff\xfe", "Authorization": b"Bearer \xff"}, timeout=10)
    assert resp.status_code in (403, 404)
    assert httpx.get(f"{manage}/v1/instances", headers={"Authorization": b"Bearer \xff"}, timeout=10).status_code == 401
