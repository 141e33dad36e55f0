"""A worker switched between prefill and decode in place: it leaves its old role before draining, its streams
finish elsewhere unchanged, it registers in the new role with a new KV event epoch, and the model stays loaded."""

from __future__ import annotations

import concurrent.futures
import itertools

import grpc
import httpx
import pytest

from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from tests.helpers import (health, instance_states, management_url, metrics_url, reference_tokens, scrape,
                           start_coordinator, start_sim_worker, start_worker, wait_for, write_config)

pytestmark = pytest.mark.system

HEALTH = {"health_config": {"check_interval_s": 0.3, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 60}}
MAX_TOKENS = 800  # long enough that 8 streams are still running when the switch lands
LONG = {"maxIterTimes": MAX_TOKENS, "maxSeqLen": 2048, "maxInputTokenLen": 2048}


def listed(coordinator) -> dict:
    return httpx.get(f"{management_url(coordinator)}/v1/instances", timeout=10).json()


def switch(coordinator, address: str, role: str, drain_timeout_s: float = 5) -> httpx.Response:
    return httpx.post(f"{management_url(coordinator)}/v1/instances/switch_role", timeout=30,
                      json={"address": address, "role": role, "drain_timeout_s": drain_timeout_s})


def test_a_simulated_decode_worker_switches_to_prefill_and_serves_prefills(model_dir, tmp_path):
    coordinator = start_coordinator(write_config(tmp_path / "c.json", [], [], model_dir, HEALTH))
    manage = management_url(coordinator)
    workers = [start_sim_worker(role, "--coordinator", manage) for role in ("prefill", "decode", "decode")]
    prefill, _, switched = workers
    try:
        wait_for(lambda: len(instance_states(coordinator)["decode"]) == 2 and instance_states(coordinator)["prefill"],
                 what="three workers registered")
        assert httpx.get(f"{manage}/v1/plan", timeout=10).json() == {"enabled": False}  # the planner is off
        resp = switch(coordinator, switched.address, "prefill")
        assert resp.status_code == 202, resp.text
        assert resp.json() == {"status": "switching", "address": switched.address, "from": "decode",
                               "to": "prefill", "in_flight": 0}
        wait_for(lambda: switched.address in instance_states(coordinator)["prefill"]
                 and switched.address not in instance_states(coordinator)["decode"], what="registered as prefill")
        assert health(switched.address, "prefill").role == "prefill"
        for _ in range(6):  # round robin: some land on the switched worker
            reply = httpx.post(f"{coordinator.address}/v1/completions", timeout=60,
                               json={"model": "pdserve-tiny", "prompt": "Hello", "max_tokens": 4})
            assert reply.status_code == 200, reply.text
        served = {i["address"]: i["served"] for i in listed(coordinator)["prefill"]}
        assert served[switched.address] > 0 and served[prefill.address] > 0
        counters = scrape(metrics_url(switched))
        assert counters[("pdserve_worker_role_switches_total", (("role", "prefill"),))] == 1
        assert counters[("pdserve_worker_model_loads_total", ())] == 0  # a simulated worker has no model
    finally:
        for process in (*workers, coordinator):
            process.stop()


def test_switches_the_worker_or_coordinator_cannot_make_are_refused_naming_why(model_dir, tmp_path):
    decode = start_sim_worker("decode")
    coordinator = start_coordinator(write_config(tmp_path / "c.json", [], [decode.address], model_dir, HEALTH))
    manage = management_url(coordinator)
    prefill = start_sim_worker("prefill", "--coordinator", manage)
    try:
        wait_for(lambda: instance_states(coordinator)["prefill"], what="the prefill worker registered")
        refused = switch(coordinator, "127.0.0.1:1", "prefill")
        assert refused.status_code == 404 and "no decode instance" in refused.json()["error"]["message"]
        refused = switch(coordinator, prefill.address, "prefill")
        assert refused.status_code == 409 and "a prefill instance already" in refused.json()["error"]["message"]
        refused = switch(coordinator, decode.address, "prefill")
        assert refused.status_code == 409 and "config file" in refused.json()["error"]["message"]
        refused = switch(coordinator, prefill.address, "decode")
        assert refused.status_code == 409 and "the last prefill instance" in refused.json()["error"]["message"]
        refused = switch(coordinator, prefill.address, "decode", drain_timeout_s=7200)
        assert refused.status_code == 400 and "drain_timeout_s" in refused.json()["error"]["message"]
        with grpc.insecure_channel(prefill.address) as channel:
            stub = pb_grpc.WorkerControlStub(channel)
            for request, wording in ((pb.SwitchRoleRequest(role="prefill"), "a prefill worker already"),
                                     (pb.SwitchRoleRequest(role="router"), "role must be"),
                                     (pb.SwitchRoleRequest(role="decode", drain_timeout_s=-1), "drain_timeout_s")):
                with pytest.raises(grpc.RpcError) as caught:
                    stub.SwitchRole(request, timeout=10)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and wording in caught.value.details()
        assert instance_states(coordinator)["prefill"] == {prefill.address: "healthy"}  # nothing changed
    finally:
        for process in (prefill, coordinator, decode):
            process.stop()


def test_a_decode_worker_carrying_8_streams_switches_and_they_finish_unchanged(model_dir, tmp_path, hf_model):
    sections = {**HEALTH, "digs_scheduler_config": {"algorithm_type": "cache_affinity"}}
    coordinator = start_coordinator(write_config(tmp_path / "c.json", [], [], model_dir, sections, **LONG))
    manage = management_url(coordinator)
    prefill = start_worker("prefill", model_dir, "--coordinator", manage)
    switched = start_worker("decode", model_dir, "--coordinator", manage)
    spare = start_worker("decode", model_dir)  # joins once the streams run on the other
    prompts = [f"Story {i}: once upon a time" for i in range(8)]
    try:
        wait_for(lambda: instance_states(coordinator)["decode"] and instance_states(coordinator)["prefill"],
                 what="both workers registered")

        def generate(prompt: str) -> list[int]:
            reply = httpx.post(f"{coordinator.address}/v1/completions", timeout=120, json={
                "model": "pdserve-tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["token_ids"]

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            uninterrupted = list(pool.map(generate, prompts))
            wait_for(lambda: listed(coordinator)["decode"][0]["outstanding_requests"] == 0, what="an idle worker")
            streams = [pool.submit(generate, prompt) for prompt in prompts]
            wait_for(lambda: listed(coordinator)["decode"][0]["outstanding_requests"] == 8, timeout_s=60,
                     what="8 streams on the decode worker")
            assert wait_for(lambda: listed(coordinator)["decode"][0]["kv_index"]["blocks"] > 0,
                            what="its blocks indexed")
            joined = httpx.post(f"{manage}/v1/instances/register", timeout=10,
                                json={"role": "decode", "address": spare.address})
            assert joined.status_code == 200, joined.text
            resp = switch(coordinator, switched.address, "prefill", drain_timeout_s=0)
            assert resp.status_code == 202 and resp.json()["in_flight"] == 8, resp.text
            outputs = [stream.result(timeout=120) for stream in streams]
        assert outputs == uninterrupted
        # And both are transformers' greedy tokens, up to its EOS (one prompt: the parity tests cover the rest).
        reference = reference_tokens(hf_model, hf_model[1](prompts[0])["input_ids"], MAX_TOKENS)
        assert outputs[0][:len(reference)] == reference
        counters = scrape(coordinator.address)
        assert counters[("pdserve_request_migrations_total", ())] == 8
        wait_for(lambda: switched.address in instance_states(coordinator)["prefill"], what="registered as prefill")
        now = listed(coordinator)
        assert [i["address"] for i in now["decode"]] == [spare.address]
        mine = next(i for i in now["prefill"] if i["address"] == switched.address)
        assert mine["kv_index"]["blocks"] == 0  # the decode role's blocks are forgotten with its epoch
        assert not any(key[0] == "pdserve_instance_kv_index_blocks" and ("role", "decode") in key[1]
                       and ("address", switched.address) in key[1] and value for key, value in counters.items())
        probes = itertools.count()
        wait_for(lambda: _prefill_on(coordinator, switched.address, next(probes)), timeout_s=60,
                 what="a prefill on the switched worker")
        worker_counters = scrape(metrics_url(switched))
        assert worker_counters[("pdserve_worker_model_loads_total", ())] == 1  # the model stayed loaded
        assert worker_counters[("pdserve_worker_role_switches_total", (("role", "prefill"),))] == 1
    finally:
        for process in (switched, spare, prefill, coordinator):
            process.stop()


def _prefill_on(coordinator, address: str, number: int) -> bool:
    """One more prompt; whether the worker at `address` has prefilled any (cache_affinity places by load and
    cache, so it may take a few)."""
    reply = httpx.post(f"{coordinator.address}/v1/completions", timeout=60, json={
        "model": "pdserve-tiny", "prompt": f"Probe {number} for the switched worker", "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    return any(i["served"] for i in listed(coordinator)["prefill"] if i["address"] == address)
