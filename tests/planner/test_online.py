"""The online planner's decisions on live snapshots, and the damping that turns them into desired counts."""

from __future__ import annotations

import dataclasses
import random

import pytest
from pydantic import ValidationError

from planner.live import Attainment, RequestTimingSummary, Snapshot
from planner.online import Damper, Decision, decide, shapes
from planner.profile import DecodePoint, PrefillPoint
from planner.settings import PlannerConfig
from planner.simulation import WorkerSettings
from planner.workload import TraceRequest, Workload

# Exact costs: prefill 2 ms per prompt token; a decode step 20 ms + 8 ms per sequence in the batch.
PREFILL_POINTS = tuple(PrefillPoint(prompt_tokens=n, prefill_ms=2 + 2.0 * n, handoff_ms=0.5, kv_bytes=n * 512)
                       for n in (64, 512, 2048))
DECODE_POINTS = tuple(DecodePoint(batch_size=b, context_tokens=b * n, step_ms=20 + 8.0 * b)
                      for b in (1, 8, 32) for n in (64, 512))


def config(**overrides) -> PlannerConfig:
    return PlannerConfig(**{"enabled": True, "ttft_ms": 5000, "tpot_ms": 120, "window_s": 30, "min_requests": 10,
                            "max_instances": 6, **overrides})


def snapshot(rate: float, prompt: int, output: int, span_s: float = 30, seed: int = 0) -> Snapshot:
    rng, t, requests = random.Random(seed), 0.0, []
    while t < span_s:
        requests.append(TraceRequest(arrival_s=round(t, 6), prompt_tokens=prompt, output_tokens=output))
        t += rng.expovariate(rate)
    return Snapshot(Workload(requests=requests, span_s=span_s), Attainment(1, 1, 1, len(requests)), len(requests),
                    PREFILL_POINTS, DECODE_POINTS, decode_profiled=True)


def test_shapes_go_smallest_first_with_each_role_at_least_its_minimum():
    sizes = shapes(config(min_per_role=1))
    assert sizes[0] == [(1, 1)] and sizes[-1] == [(1, 5), (2, 4), (3, 3), (4, 2), (5, 1)]
    assert all(p >= 2 and d >= 2 for size in shapes(config(min_per_role=2)) for p, d in size)


def test_too_few_requests_or_no_timings_of_a_role_is_warming_up():
    few = snapshot(rate=0.2, prompt=100, output=10)
    assert decide(config(), few, WorkerSettings(), 0, (1, 1)).reason == "warming_up"
    untimed = Snapshot(snapshot(2, 100, 10).workload, Attainment(1, 1, 1, 60), 60, PREFILL_POINTS, ())
    decision = decide(config(), untimed, WorkerSettings(), 0, (1, 1))
    assert decision.reason == "warming_up" and decision.counts is None


def test_long_prompts_with_short_answers_get_more_prefill_and_the_reverse_more_decode():
    prefill_heavy = decide(config(), snapshot(1.25, 1000, 8), WorkerSettings(max_running=256), 0, (3, 3))
    decode_heavy = decide(config(), snapshot(1.25, 48, 300), WorkerSettings(max_running=256), 0, (3, 3))
    assert prefill_heavy.reason == decode_heavy.reason == "meets_slo"
    assert prefill_heavy.prefill > prefill_heavy.decode and prefill_heavy.prefill >= 3
    assert decode_heavy.decode > decode_heavy.prefill and decode_heavy.decode >= 3
    assert "predicted p90 TTFT" in prefill_heavy.message and prefill_heavy.workload["fitted_costs"]


def test_a_load_no_shape_meets_asks_for_the_most_instances_serving_most_within_the_slos():
    decision = decide(config(window_s=10), snapshot(4, 48, 300, span_s=10), WorkerSettings(max_running=256), 0, (1, 1))
    assert decision.reason == "best_effort" and decision.prefill + decision.decode == 6


def test_fewer_instances_than_now_need_room_to_spare():
    load = snapshot(1.25, 48, 300)
    free = decide(config(scale_down_headroom=1.0), load, WorkerSettings(max_running=256), 0, (1, 5))
    strict = decide(config(scale_down_headroom=0.05), load, WorkerSettings(max_running=256), 0, (1, 5))
    assert sum(free.counts) < 6  # it meets the SLOs with fewer
    assert strict.counts != free.counts and sum(strict.counts) >= sum(free.counts)


def test_a_load_that_grew_in_the_newest_half_of_the_window_is_answered_at_once():
    quiet, busy = snapshot(0.3, 48, 300, span_s=15, seed=1), snapshot(2.0, 48, 300, span_s=15, seed=2)

    def window(first: Snapshot, then: Snapshot) -> Snapshot:
        rows = [*first.workload.requests,
                *(r.model_copy(update={"arrival_s": r.arrival_s + 15}) for r in then.workload.requests)]
        return Snapshot(Workload(requests=rows, span_s=30), Attainment(1, 1, 1, len(rows)), len(rows),
                        PREFILL_POINTS, DECODE_POINTS, decode_profiled=True)

    grown = decide(config(), window(quiet, busy), WorkerSettings(max_running=256), 0, (1, 1))
    faded = decide(config(), window(busy, quiet), WorkerSettings(max_running=256), 0, (1, 1))
    assert grown.decode > faded.decode  # the same requests: the newest half decides when it asks for more


def decision(prefill: int, decode: int) -> Decision:
    return Decision("meets_slo", "", prefill, decode)


def test_the_desired_counts_change_after_agreeing_decisions_and_not_within_the_cooldown():
    damper = Damper(config(confirmations=2, cooldown_s=20, scale_down_after_s=0))
    assert not damper.offer(decision(2, 2), 0) and damper.desired is None
    assert damper.offer(decision(2, 2), 5) and damper.desired == (2, 2)
    assert not damper.offer(decision(1, 3), 10) and not damper.offer(decision(1, 3), 15)  # within the cooldown
    assert damper.held(decision(1, 3))
    assert damper.offer(decision(1, 3), 26) and damper.desired == (1, 3)
    assert not damper.offer(Decision("warming_up", ""), 60) and damper.desired == (1, 3)


def test_a_disagreeing_decision_restarts_the_count():
    damper = Damper(config(confirmations=2, cooldown_s=0))
    damper.offer(decision(2, 2), 0)
    assert not damper.offer(decision(3, 1), 1) and not damper.offer(decision(2, 2), 2)
    assert damper.offer(decision(2, 2), 3)


def test_fewer_instances_in_all_only_after_being_asked_for_that_long():
    damper = Damper(config(confirmations=1, cooldown_s=0, scale_down_after_s=60))
    assert damper.offer(decision(3, 3), 0)
    assert damper.offer(decision(2, 4), 1)  # a switch: as many instances
    assert not damper.offer(decision(1, 3), 2) and not damper.offer(decision(1, 3), 40)
    assert damper.offer(decision(1, 3), 62) and damper.desired == (1, 3)
    assert damper.offer(decision(2, 4), 63)  # more: at once


def test_the_config_needs_room_for_each_role_and_names_the_fields(tmp_path):
    with pytest.raises(ValidationError, match="min_per_role"):
        PlannerConfig(max_instances=3, min_per_role=2)
    with pytest.raises(ValidationError, match="scale_down_headroom"):
        PlannerConfig(scale_down_headroom=0)
    resolved = PlannerConfig(prefill_profile="p.json", decode_profile="/abs/d.json").resolved(tmp_path)
    assert resolved.prefill_profile == str(tmp_path / "p.json") and resolved.decode_profile == "/abs/d.json"


def test_the_split_running_is_kept_while_it_meets_the_slos_among_shapes_of_its_size():
    load = snapshot(0.5, 200, 40)  # any split of 6 meets the SLOs; none smaller has the room asked for
    strict = config(scale_down_headroom=0.01)
    for running in ((2, 4), (4, 2)):
        assert decide(strict, load, WorkerSettings(), 0, running).counts == running


def test_what_the_clients_saw_of_the_running_cluster_corrects_the_targets():
    load = snapshot(1.0, 48, 300)
    plain = decide(config(), load, WorkerSettings(max_running=256), 0, (2, 3))
    seen = RequestTimingSummary(ttft_ms=200, tpot_ms=240, requests=len(load.workload.requests))
    slower = dataclasses.replace(load, observed=seen)  # the clients saw far slower tokens than modelled
    corrected = decide(config(), slower, WorkerSettings(max_running=256), 0, (2, 3), calibrate=True)
    assert corrected.workload["correction"]["tpot"] > 1.5 and corrected.decode > plain.decode
    assert decide(config(), slower, WorkerSettings(max_running=256), 0, (2, 3)).counts == plain.counts


def test_clients_that_saw_better_than_modelled_never_loosen_the_targets():
    # During a shift to long answers the finished requests are the short ones before it: fast tokens, while the
    # window's running long answers make the model predict slow ones. The targets must stay.
    load = snapshot(1.25, 48, 300)
    seen = RequestTimingSummary(ttft_ms=50, tpot_ms=30, requests=len(load.workload.requests))
    corrected = decide(config(), dataclasses.replace(load, observed=seen), WorkerSettings(max_running=256), 0,
                       (5, 1), calibrate=True)
    assert corrected.workload["correction"] == {"ttft": 1.0, "tpot": 1.0}
    assert corrected.counts == decide(config(), load, WorkerSettings(max_running=256), 0, (5, 1)).counts
    assert corrected.decode >= 3
