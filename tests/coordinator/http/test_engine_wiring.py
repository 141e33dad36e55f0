"""create_app gives a vLLM fleet's client what its config and routing policy ask: the load read only for a policy
that routes on it, seeded sampling only without CPU instances."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from coordinator.config import parse_config
from coordinator.http.app import create_app
from coordinator.state import STATE


def vllm_app(model_dir, algorithm: str, device: str, speculative: str = "", **sections):
    instances = {"prefill": [{"engine": "vllm", "url": "http://127.0.0.1:8100", "device": device}],
                 "decode": [{"engine": "vllm", "url": "http://127.0.0.1:8200", "device": device,
                             "speculative": speculative}]}
    return create_app(parse_config({"model_config": {"modelWeightPath": str(model_dir)}, "instances": instances,
                                    "digs_scheduler_config": {"algorithm_type": algorithm}, **sections}))


@pytest.mark.parametrize("algorithm, reads_load", [("round_robin", False), ("load_balance", True),
                                                   ("cache_affinity", True)])
def test_a_vllm_fleet_reads_load_only_under_a_policy_that_routes_on_it(model_dir, algorithm, reads_load):
    assert vllm_app(model_dir, algorithm, "gpu")[STATE].client.read_load is reads_load


@pytest.mark.parametrize("device, seeded", [("gpu", True), ("cpu", False)])
def test_a_vllm_fleet_with_cpu_instances_does_not_sample_from_seeds(model_dir, device, seeded):
    assert vllm_app(model_dir, "round_robin", device)[STATE].client.seeded_sampling is seeded


def test_a_vllm_fleet_makes_no_peer_pulls_and_pdserve_workers_do(model_dir):
    assert vllm_app(model_dir, "cache_affinity", "gpu")[STATE].router.policy.peer_pulls is False
    own = create_app(parse_config({"model_config": {"modelWeightPath": str(model_dir)},
                                   "instances": {"prefill": [{"address": "127.0.0.1:1"}],
                                                 "decode": [{"address": "127.0.0.1:2"}]},
                                   "digs_scheduler_config": {"algorithm_type": "cache_affinity"}}))
    assert own[STATE].router.policy.peer_pulls is True


async def test_a_vllm_fleet_drafting_on_every_request_refuses_drafting_off_naming_the_header_and_keeps_no_corpus(
        model_dir):
    app = vllm_app(model_dir, "round_robin", "gpu", "ngram", speculative_config={"enabled": True})
    assert app[STATE].pipeline.drafts is None  # vLLM instances are never sent hints
    async with TestClient(TestServer(app)) as client:
        async with client.post("/v1/completions", json={"model": "pdserve-tiny", "prompt": "hi", "max_tokens": 2},
                               headers={"x-pdserve-speculative": "off"}) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
    assert error["param"] == "x-pdserve-speculative"
    assert "the vLLM engine cannot turn drafting off per request" in error["message"]


def test_pdserve_workers_keep_a_corpus_when_speculative_config_is_enabled(model_dir):
    app = create_app(parse_config({"model_config": {"modelWeightPath": str(model_dir)},
                                   "speculative_config": {"enabled": True}}))
    assert app[STATE].pipeline.drafts is not None
