"""The pool's orders give the same picks as scanning every candidate did, whatever happens to the instances."""

from __future__ import annotations

import random

import pytest

from coordinator.workers.instances import InstanceRegistry, ReportedLoad
from coordinator.scheduling.load_order import LoadOrder, nth_outside
from coordinator.scheduling.policies import (
    CacheAffinityPolicy,
    LoadBalancePolicy,
    RoundRobinPolicy,
    decode_load,
    prefill_load,
)
from coordinator.scheduling.kv_index import KvIndex
from coordinator.scheduling.router import Router
from tests.helpers import kv_blocks_batch


class ScanningPolicies:
    """The policies with every candidate looked at per request (the reference the orders must match)."""

    def __init__(self, algorithm: str, prefill_weight: float = 1.0, decode_weight: float = 64.0):
        self.algorithm = algorithm
        self.turn = {"prefill": 0, "decode": 0}
        self.weights = {"prefill": prefill_weight, "decode": decode_weight}

    def _next(self, role, candidates):
        ordered = sorted(candidates, key=lambda i: i.address)
        choice = ordered[self.turn[role] % len(ordered)]
        self.turn[role] += 1
        return choice

    def _least(self, role, candidates, load):
        lowest = min(load(i) for i in candidates)
        return self._next(role, [i for i in candidates if load(i) == lowest])

    def choose(self, role, candidates, prompt_len, cached):
        if self.algorithm == "round_robin":
            return self._next(role, candidates)
        load = prefill_load if role == "prefill" else decode_load
        best = self._least(role, candidates, load)
        if self.algorithm == "cache_affinity":
            weight = self.weights[role]
            best_cost = prompt_len - cached.get(best.address, 0) + weight * load(best)
            for address, tokens in cached.items():
                instance = next((i for i in candidates if i.address == address), None)
                if instance is not None and prompt_len - tokens + weight * load(instance) < best_cost:
                    best, best_cost = instance, prompt_len - tokens + weight * load(instance)
        return best


def make_policy(algorithm: str, index: KvIndex):
    if algorithm == "round_robin":
        return RoundRobinPolicy()
    if algorithm == "load_balance":
        return LoadBalancePolicy()
    return CacheAffinityPolicy(index)


def test_nth_outside_counts_round_the_addresses_left():
    ordered = ["a", "b", "c", "d"]
    assert [nth_outside(ordered, turn, set()) for turn in range(5)] == ["a", "b", "c", "d", "a"]
    assert [nth_outside(ordered, turn, {"b", "x"}) for turn in range(4)] == ["a", "c", "d", "a"]
    assert [nth_outside(ordered, turn, {"a", "b"}) for turn in range(3)] == ["c", "d", "c"]
    assert nth_outside(ordered, 7, {"a", "b", "c", "d"}) is None and nth_outside([], 0, set()) is None


def test_a_load_order_follows_changes_and_leaves_with_the_instance():
    registry = InstanceRegistry([], ["d0:1", "d1:1", "d2:1"])
    order = LoadOrder(registry.pool("decode"), decode_load)
    assert order.least() == (0, ["d0:1", "d1:1", "d2:1"])
    registry.get("decode", "d0:1").outstanding_requests = 2
    registry.get("decode", "d1:1").reported = ReportedLoad(num_running=1)
    assert order.least() == (0, ["d2:1"])
    assert order.least(exclude={"d2:1"}) == (1, ["d1:1"])
    registry.record_failure(registry.get("decode", "d2:1"), "gone", gone=True)
    assert order.least() == (1, ["d1:1"])
    registry.deregister("decode", "d1:1")
    assert order.least() == (2, ["d0:1"])
    assert order.least(exclude={"d0:1"}) is None
    registry.register("decode", "d1:1")  # a new instance: idle, routable at once
    assert order.least() == (0, ["d1:1"])


@pytest.mark.parametrize("algorithm", ["round_robin", "load_balance", "cache_affinity"])
@pytest.mark.parametrize("seed", range(4))
def test_picks_match_a_scan_of_every_candidate(algorithm, seed):
    rng = random.Random(seed)
    registry = InstanceRegistry([f"p{i}:1" for i in range(6)], [f"d{i}:1" for i in range(6)], failure_threshold=2)
    index = KvIndex()
    router = Router(registry, make_policy(algorithm, index))
    reference = ScanningPolicies(algorithm)
    prompts = [[rng.randrange(3)] * 16 + [rng.randrange(50) for _ in range(rng.randrange(40))] for _ in range(20)]
    for address in [f"{role}{i}:1" for role in "pd" for i in range(8)]:  # what each instance's cache holds
        held = [t for p in rng.sample(prompts, 3) for t in p]
        index.apply(address, kv_blocks_batch("prefill" if address[0] == "p" else "decode", held[:rng.randrange(64)]))
    leases = []
    priced = 0  # picks where some instance held part of the prompt
    for step in range(1500):
        action = rng.random()
        role = rng.choice(["prefill", "decode"])
        if action < 0.45:
            prompt = rng.choice(prompts)
            exclude = {f"{role[0]}{rng.randrange(8)}:1" for _ in range(rng.choice([0, 0, 0, 1, 2, 5]))}
            candidates = registry.available(role, exclude)
            cached = router.policy.match(prompt).of(role)
            priced += bool(cached)
            expected = reference.choose(role, candidates, len(prompt), cached) if candidates else None
            choose = router.policy.choose_prefill if role == "prefill" else router.policy.choose_decode
            chosen = choose(registry.pool(role), len(prompt), cached, exclude)
            assert chosen is expected, (step, role, exclude)
            if chosen is not None and rng.random() < 0.7:
                lease = registry.lease(chosen, prompt_tokens=len(prompt) * 10 if role == "prefill" else 0)
                lease.__enter__()
                leases.append(lease)
        elif action < 0.65 and leases:
            leases.pop(rng.randrange(len(leases))).__exit__(None, None, None)
        else:
            instances = registry.instances(role)
            if not instances:
                continue
            instance = rng.choice(instances)
            event = rng.random()
            if event < 0.5:
                registry.record_health(instance, ReportedLoad(
                    num_running=rng.randrange(3), num_waiting=rng.randrange(2), kv_used_tokens=rng.randrange(4),
                    kv_capacity_tokens=4, queued_prompt_tokens=rng.choice([0, 0, 40, 80, 200])), draining=False)
            elif event < 0.7:
                registry.record_failure(instance, "boom", gone=rng.random() < 0.3)
            elif event < 0.8:
                registry.record_health(instance, instance.reported, draining=True)
            elif event < 0.9:
                registry.deregister(role, instance.address)
            else:
                registry.register(role, f"{role[0]}{rng.randrange(8)}:1")
    assert (priced > 100) == (algorithm == "cache_affinity")
