"""The search: minimal, monotonic in instances, naming the bottleneck, and clear when no cluster will do."""

from __future__ import annotations

import itertools

import pytest

from planner.plan import NoPlanError, Planner
from planner.slo import Slo
from planner.workload import SyntheticWorkload
from tests.planner.helpers import profiles

SLO = Slo(ttft_ms=200, tpot_ms=40, percentile=90)


def workload(spec: str = "rate=25,count=200,prompt=uniform:128:384,output=uniform:20:60,seed=3"):
    return SyntheticWorkload.parse(spec).generate()


def test_more_instances_of_a_role_never_worsen_its_own_slo_figure():
    planner = Planner(workload(), *profiles(), SLO, max_instances=8)
    grid = {(p, d): planner.predict(p, d).report for p, d in itertools.product(range(1, 5), range(1, 5))}
    for (p, d), report in grid.items():
        if p < 4:
            assert grid[p + 1, d].ttft_ms <= report.ttft_ms + 1e-9
        if d < 4:
            assert grid[p, d + 1].tpot_ms <= report.tpot_ms + 1e-9
            assert grid[p, d + 1].goodput_rps >= report.goodput_rps


def test_recommendation_meets_the_slos_and_no_smaller_cluster_does():
    planner = Planner(workload(), *profiles(), SLO, max_instances=8)
    chosen = planner.recommend().chosen
    assert chosen.report.met
    total = chosen.num_prefill + chosen.num_decode
    smaller = [(p, d) for p in range(1, total) for d in range(1, total - p)]
    assert smaller and not any(planner.predict(p, d).report.met for p, d in smaller)


def test_a_decode_heavy_workload_names_decode_the_bottleneck_and_one_fewer_misses():
    recommendation = Planner(workload(), *profiles(), SLO, max_instances=8).recommend()
    assert recommendation.bottleneck == "decode" and recommendation.chosen.num_decode >= 2
    assert not recommendation.one_fewer["decode"].report.met


def test_a_prefill_heavy_workload_names_prefill_the_bottleneck_and_one_fewer_misses():
    long_prompts = workload("rate=12,count=150,prompt=uniform:800:1600,output=4,seed=5")
    slo = Slo(ttft_ms=400, tpot_ms=40)
    recommendation = Planner(long_prompts, *profiles(), slo, max_instances=8).recommend()
    assert recommendation.bottleneck == "prefill" and recommendation.chosen.num_prefill >= 2
    assert not recommendation.one_fewer["prefill"].report.met


def test_a_tpot_below_one_step_has_no_plan_and_says_which_role():
    with pytest.raises(NoPlanError, match="each role miss p90 TPOT 10 ms"):
        Planner(workload(), *profiles(), Slo(ttft_ms=200, tpot_ms=10), max_instances=4).recommend()
