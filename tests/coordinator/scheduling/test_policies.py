"""Routing policies choose as documented, from registry state built by hand (no workers)."""

from __future__ import annotations

from collections import Counter

import pytest

from coordinator.errors import WorkerError
from coordinator.workers.instances import InstanceRegistry, ReportedLoad
from coordinator.scheduling.kv_index import KvIndex
from coordinator.scheduling.policies import CacheAffinityPolicy, LoadBalancePolicy, RoundRobinPolicy
from coordinator.scheduling.router import Router
from tests.helpers import kv_blocks_batch


def make_registry(num_prefill: int = 3, num_decode: int = 3) -> InstanceRegistry:
    return InstanceRegistry([f"p{i}:1" for i in range(num_prefill)], [f"d{i}:1" for i in range(num_decode)])


def prompt(length: int, start: int = 0) -> list[int]:
    return list(range(start, start + length))


def test_round_robin_visits_every_instance_in_turn():
    registry = make_registry()
    router = Router(registry, RoundRobinPolicy())
    routes = [router.route(prompt(8)) for _ in range(6)]
    assert [r.prefill.address for r in routes] == ["p0:1", "p1:1", "p2:1"] * 2
    assert [r.decode.address for r in routes] == ["d0:1", "d1:1", "d2:1"] * 2


def test_only_the_policies_that_route_on_load_ask_for_it():
    assert not RoundRobinPolicy.reads_load
    assert LoadBalancePolicy.reads_load and CacheAffinityPolicy.reads_load


def test_round_robin_skips_instances_whose_circuit_is_open():
    registry = make_registry()
    registry.record_failure(registry.get("decode", "d1:1"), "connection refused", gone=True)
    router = Router(registry, RoundRobinPolicy())
    assert {router.route(prompt(8)).decode.address for _ in range(6)} == {"d0:1", "d2:1"}


def test_load_balance_picks_the_prefill_with_fewest_queued_prompt_tokens():
    registry = make_registry()
    for address, queued in (("p0:1", 900), ("p1:1", 100), ("p2:1", 400)):
        registry.get("prefill", address).reported = ReportedLoad(queued_prompt_tokens=queued)
    policy = LoadBalancePolicy()
    assert policy.choose_prefill(registry.pool("prefill"), 8, {}).address == "p1:1"


def test_load_balance_counts_work_sent_since_the_last_report():
    registry = make_registry(num_prefill=2)
    registry.get("prefill", "p0:1").reported = ReportedLoad(queued_prompt_tokens=100)
    registry.get("prefill", "p1:1").outstanding_prompt_tokens = 500  # sent after its last report said 0
    policy = LoadBalancePolicy()
    assert policy.choose_prefill(registry.pool("prefill"), 8, {}).address == "p0:1"


def test_load_balance_picks_the_decode_with_fewest_sequences_then_least_kv_use():
    registry = make_registry()
    registry.get("decode", "d0:1").reported = ReportedLoad(num_running=4, kv_used_tokens=10, kv_capacity_tokens=100)
    registry.get("decode", "d1:1").reported = ReportedLoad(num_running=2, kv_used_tokens=90, kv_capacity_tokens=100)
    registry.get("decode", "d2:1").reported = ReportedLoad(num_running=2, kv_used_tokens=20, kv_capacity_tokens=100)
    assert LoadBalancePolicy().choose_decode(registry.pool("decode"), 8, {}).address == "d2:1"


def test_load_balance_spreads_a_burst_over_idle_instances():
    registry = make_registry(num_decode=4)
    policy = LoadBalancePolicy()
    chosen = Counter()
    for _ in range(8):
        instance = policy.choose_decode(registry.pool("decode"), 8, {})
        instance.outstanding_requests += 1  # what the pipeline does while the request runs
        chosen[instance.address] += 1
    assert set(chosen.values()) == {2}


def affinity_router(registry: InstanceRegistry, local_prefill_max_tokens: int = 0, expected_ttl_s: float = 0.0,
                    **weights) -> tuple[Router, KvIndex]:
    index = KvIndex(expected_ttl_s)
    return Router(registry, CacheAffinityPolicy(index, **weights), local_prefill_max_tokens), index


def test_cache_affinity_sends_a_prompt_to_the_prefill_instance_holding_its_prefix():
    registry = make_registry()
    router, index = affinity_router(registry)
    index.apply("p2:1", kv_blocks_batch("prefill", prompt(48)))
    placement = router.route(prompt(48) + [7, 7, 7])
    assert placement.prefill.address == "p2:1" and placement.prefill_cached_tokens == 48
    assert {router.route(prompt(40, start=1000 + 100 * i)).prefill.address for i in range(6)} == {
        "p0:1", "p1:1", "p2:1"}  # prompts nobody holds spread by load


def test_cache_affinity_prefers_the_instance_holding_the_longest_prefix():
    registry = make_registry()
    router, index = affinity_router(registry)
    index.apply("p0:1", kv_blocks_batch("prefill", prompt(16)))
    index.apply("p2:1", kv_blocks_batch("prefill", prompt(64)))
    assert router.route(prompt(64) + [5]).prefill.address == "p2:1"


def test_cache_affinity_weighs_queued_tokens_against_cached_ones():
    registry = make_registry()
    router, index = affinity_router(registry)
    index.apply("p0:1", kv_blocks_batch("prefill", prompt(64)))
    registry.get("prefill", "p0:1").outstanding_prompt_tokens = 50  # 100 - 64 + 50 = 86 < 100 on an idle one
    assert router.route(prompt(100)).prefill.address == "p0:1"
    registry.get("prefill", "p0:1").outstanding_prompt_tokens = 70  # 106 > 100
    assert router.route(prompt(100)).prefill.address != "p0:1"


def test_cache_affinity_sends_a_conversation_back_to_the_decode_instance_holding_it_unless_overloaded():
    registry = make_registry(num_decode=2)
    router, index = affinity_router(registry, decode_load_weight=16)
    index.apply("d1:1", kv_blocks_batch("decode", prompt(96)))
    registry.get("decode", "d1:1").outstanding_requests = 4  # 100 - 96 + 16 * 4 = 68 < 100 on the idle d0
    placement = router.route(prompt(100))
    assert placement.decode.address == "d1:1" and placement.decode_cached_tokens == 96
    registry.get("decode", "d1:1").outstanding_requests = 7  # 4 + 112 > 100
    assert router.route(prompt(100)).decode.address == "d0:1"


def test_cache_affinity_prices_loading_an_adapter_beside_the_cached_blocks():
    registry = make_registry()
    router, index = affinity_router(registry, lora_load_tokens=64)
    index.apply("p0:1", kv_blocks_batch("prefill", prompt(48)))
    # p0 holds 48 of 100 tokens but has not loaded the adapter; p1, the least loaded, has.
    for address in ("p0:1", "p2:1"):
        registry.get("prefill", address).outstanding_prompt_tokens = 1
    registry.get("prefill", "p1:1").reported = ReportedLoad(loras=frozenset({"a1"}))
    assert router.route(prompt(100), lora="a1").prefill.address == "p1:1"  # 100 + 0 < 52 + 1 + 64
    assert router.route(prompt(100)).prefill.address == "p0:1"  # the base model: no load to price
    registry.get("prefill", "p0:1").reported = ReportedLoad(loras=frozenset({"a1"}))
    assert router.route(prompt(100), lora="a1").prefill.address == "p0:1"  # 52 + 1 < 100


def test_cache_affinity_sends_a_fresh_prompt_where_its_adapter_is_loaded_unless_that_one_is_busier():
    registry = make_registry()
    router, _ = affinity_router(registry, lora_load_tokens=64)
    registry.get("prefill", "p2:1").reported = ReportedLoad(loras=frozenset({"a1"}))
    registry.get("prefill", "p2:1").outstanding_prompt_tokens = 50  # 100 + 50 < 100 + 64 on an idle one
    assert router.route(prompt(100, start=5000), lora="a1").prefill.address == "p2:1"
    registry.get("prefill", "p2:1").outstanding_prompt_tokens = 80  # 180 > 164
    assert router.route(prompt(100, start=6000), lora="a1").prefill.address != "p2:1"


def test_cache_affinity_ignores_an_instance_that_is_out_of_rotation():
    registry = make_registry()
    router, index = affinity_router(registry)
    index.apply("p0:1", kv_blocks_batch("prefill", prompt(32)))
    registry.record_failure(registry.get("prefill", "p0:1"), "gone", gone=True)
    assert router.route(prompt(40)).prefill.address != "p0:1"


def test_conditional_disaggregation_prefills_locally_when_the_decode_worker_lacks_little_of_the_prompt():
    registry = make_registry(num_decode=1)
    router, index = affinity_router(registry, local_prefill_max_tokens=16)
    assert router.route(prompt(100)).prefill is not None  # 100 uncached tokens: disaggregated
    index.apply("d0:1", kv_blocks_batch("decode", prompt(96)))
    placement = router.route(prompt(100))  # 4 uncached tokens: the decode worker prefills them
    assert placement.prefill is None and placement.decode_cached_tokens == 96


def test_short_prompts_are_prefilled_on_the_decode_worker_when_enabled():
    router = Router(make_registry(), RoundRobinPolicy(), local_prefill_max_tokens=16)
    assert router.route(prompt(15)).prefill is None
    assert router.route(prompt(16)).prefill is not None
    assert Router(make_registry(), RoundRobinPolicy()).route(prompt(1)).prefill is not None  # off by default


def test_no_routable_instance_is_a_503_naming_each_instance_state():
    registry = make_registry(num_decode=1)
    registry.record_failure(registry.get("decode", "d0:1"), "connection refused", gone=True)
    with pytest.raises(WorkerError) as err:
        Router(registry, RoundRobinPolicy()).route(prompt(4))
    assert err.value.status == 503
    assert "d0:1: unhealthy (connection refused)" in err.value.message


def test_cache_affinity_sends_a_burst_sharing_a_new_prefix_to_one_prefill_instance():
    registry = make_registry()
    router, index = affinity_router(registry, expected_ttl_s=60)
    for address in ("p0:1", "p1:1", "p2:1"):
        index.apply(address, kv_blocks_batch("prefill", []))  # following their (empty) caches
    shared = prompt(992)
    chosen = set()
    for i in range(16):
        placement = router.route(shared + [5000 + i] * 8)
        chosen.add(placement.prefill.address)
        placement.prefill.outstanding_prompt_tokens += 1000 - placement.prefill_cached_tokens
    assert len(chosen) == 1


def test_cache_affinity_prices_tier_blocks_between_pool_blocks_and_computing():
    registry = make_registry()
    router, index = affinity_router(registry, tier_token_cost=0.1)
    index.apply("p1:1", kv_blocks_batch("prefill", prompt(96), medium=1))  # all in its tier: 100 - 96 + 9.6
    registry.get("prefill", "p1:1").outstanding_prompt_tokens = 10  # 23.6 in all
    index.apply("p2:1", kv_blocks_batch("prefill", prompt(96)))  # in its pool: 100 - 96 + 20 = 24
    registry.get("prefill", "p2:1").outstanding_prompt_tokens = 20
    assert router.route(prompt(100)).prefill.address == "p1:1"
    registry.get("prefill", "p1:1").outstanding_prompt_tokens = 16  # 29.6 > 24
    assert router.route(prompt(100)).prefill.address == "p2:1"


def test_cache_affinity_has_a_prefill_instance_pull_a_prefix_another_instance_holds():
    registry = make_registry(num_decode=2)
    router, index = affinity_router(registry, peer_pulls=True, pull_min_tokens=32, decode_load_weight=0)
    index.apply("d1:1", kv_blocks_batch("decode", prompt(96)))  # only a decode instance holds the prefix
    placement = router.route(prompt(100))
    assert placement.pull_from == "d1:1" and placement.pull_tokens == 96
    assert placement.prefill_covered_tokens == 96


def test_cache_affinity_prefers_pulling_to_a_busy_holder_and_skips_small_pulls():
    registry = make_registry()
    router, index = affinity_router(registry, peer_pulls=True, pull_min_tokens=32, pull_token_cost=0.2)
    index.apply("p1:1", kv_blocks_batch("prefill", prompt(96)))
    registry.get("prefill", "p1:1").outstanding_prompt_tokens = 50  # 4 + 50 = 54 > 4 + 0.2 x 96 = 23.2 elsewhere
    placement = router.route(prompt(100))
    assert placement.prefill.address != "p1:1" and placement.pull_from == "p1:1"
    small, index = affinity_router(make_registry(), peer_pulls=True, pull_min_tokens=64)
    index.apply("p1:1", kv_blocks_batch("prefill", prompt(48)))
    registry = small.registry
    registry.get("prefill", "p1:1").outstanding_prompt_tokens = 500
    placement = small.route(prompt(100))
    assert placement.prefill.address != "p1:1" and placement.pull_from == ""  # 48 < 64: computed


def test_no_pulls_without_peer_pulls():
    registry = make_registry()
    router, index = affinity_router(registry, peer_pulls=False)
    index.apply("p1:1", kv_blocks_batch("prefill", prompt(96)))
    registry.get("prefill", "p1:1").outstanding_prompt_tokens = 1000
    assert router.route(prompt(100)).pull_from == ""


def test_no_pull_is_named_for_a_prompt_a_worker_cannot_pull_or_from_an_instance_that_failed_it():
    registry = make_registry(num_decode=2)
    router, index = affinity_router(registry, peer_pulls=True, pull_min_tokens=32, decode_load_weight=0)
    index.apply("d1:1", kv_blocks_batch("decode", prompt(96)))
    assert router.route(prompt(100), pullable=False).pull_from == ""  # under an adapter, or with images
    assert router.route(prompt(100), exclude_decode={"d1:1"}).pull_from == ""


def test_blocks_only_expected_on_the_decode_worker_do_not_make_it_prefill_locally():
    registry = make_registry(num_decode=1)
    router, index = affinity_router(registry, local_prefill_max_tokens=50, expected_ttl_s=60)
    for address in ("d0:1", "p0:1", "p1:1", "p2:1"):
        index.apply(address, kv_blocks_batch("decode" if address.startswith("d") else "prefill", []))
    assert router.route(prompt(100)).prefill is not None  # 100 uncached >= 50: disaggregated
    assert router.route(prompt(100)).prefill is not None  # its blocks only expected on d0: still disaggregated
