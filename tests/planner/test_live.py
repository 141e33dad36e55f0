"""What the online planner keeps of live traffic: the window's requests (those in flight too), the attainment, and
the timings its cost fits are made from."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from planner.live import LiveWorkload, costs
from planner.profile import DecodeCosts, DecodePoint, ProfileError, WorkerProfile
from planner.settings import PlannerConfig
from tests.planner.helpers import prefill_costs


@dataclass
class Progress:
    count: int = 0
    first_at: float = 0.0
    last_at: float = 0.0


def live(**overrides) -> LiveWorkload:
    return LiveWorkload(PlannerConfig(**{"enabled": True, "ttft_ms": 1000, "tpot_ms": 50, "window_s": 30,
                                         **overrides}))


def finish(workload: LiveWorkload, arrived: float, prompt: int, output: int, ttft_ms: float, tpot_ms: float,
           steps=(20.0, 22.0, 21.0), batch: int = 4):
    request = workload.arrive(arrived, prompt, 1, Progress(count=output))
    workload.record(request, ttft_ms, tpot_ms, forward_ms=50.0, handoff_ms=3.0, kv_bytes=prompt * 100,
                    step_ms=list(steps), batch_size=batch)
    return request


def test_the_window_holds_requests_by_arrival_and_drops_older_ones():
    workload = live()
    finish(workload, 0.0, 100, 10, 100, 20)
    finish(workload, 20.0, 200, 30, 100, 20)
    snapshot = workload.snapshot(now=40.0)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in snapshot.workload.requests] == [(0.0, 200, 30)]
    assert snapshot.workload.span_s == 30 and snapshot.finished == 1


def test_a_request_in_flight_counts_with_the_most_it_will_make():
    workload = live()
    finish(workload, 0.0, 100, 40, 100, 20)
    workload.arrive(1.0, 100, 300, Progress(count=5, first_at=1.1, last_at=1.2))  # ignore_eos, max_tokens 300
    workload.arrive(2.0, 100, 1, Progress(count=60, first_at=2.1, last_at=3.0))  # past the typical answer
    workload.arrive(3.0, 100, 1, Progress(count=2, first_at=3.1, last_at=3.12))  # the typical answer
    outputs = [r.output_tokens for r in workload.snapshot(now=5.0).workload.requests]
    assert outputs == [40, 300, 61, 40]


def test_attainment_counts_requests_in_flight_that_already_missed_a_target():
    workload = live()
    finish(workload, 0.0, 100, 10, ttft_ms=500, tpot_ms=20)  # within both
    finish(workload, 1.0, 100, 10, ttft_ms=1500, tpot_ms=20)  # TTFT missed
    workload.arrive(2.0, 100, 1, Progress())  # no token after 2 s: TTFT missed already
    workload.arrive(3.5, 100, 1, Progress(count=11, first_at=3.6, last_at=4.6))  # 100 ms per token: TPOT missed
    snapshot = workload.snapshot(now=4.0)
    attainment = snapshot.attainment
    assert (attainment.ttft, attainment.tpot, attainment.both, attainment.requests) == (0.5, 0.75, 0.25, 4)
    # What clients saw, for the model's correction: the finished requests' p90 (linear, as the SLO report's).
    assert (snapshot.observed.ttft_ms, snapshot.observed.tpot_ms, snapshot.observed.requests) == (1400.0, 20.0, 2)


def test_an_abandoned_request_leaves_the_workload():
    workload = live()
    request = workload.arrive(0.0, 100, 1, Progress())
    workload.abandon(request)
    workload.abandon(request)  # twice: no error
    assert workload.snapshot(now=1.0).workload is None


def test_finished_requests_add_timings_of_each_role():
    workload = live(profile_points=8)
    for i in range(10):
        finish(workload, float(i), 100 + i, 10, 100, 20, batch=i + 1)
    snapshot = workload.snapshot(now=10.0)
    assert len(snapshot.prefill_points) == len(snapshot.decode_points) == 8  # the newest 8
    point = snapshot.decode_points[-1]
    assert (point.batch_size, point.step_ms, point.context_tokens) == (10, 21.0, 10 * (109 + 5))
    assert snapshot.prefill_points[-1].prompt_tokens == 109 and snapshot.prefill_points[-1].prefill_ms == 50.0
    prefill, decode = costs(snapshot)
    assert decode.ms_per_context_token == 0  # live points cannot price context apart from the batch


def test_a_request_the_decode_worker_prefilled_itself_adds_no_prefill_timing():
    workload = live()
    request = workload.arrive(0.0, 10, 1, Progress(count=1))
    workload.record(request, 5, 0, forward_ms=0.0, handoff_ms=0.0, kv_bytes=0, step_ms=[], batch_size=1)
    snapshot = workload.snapshot(now=1.0)
    assert not snapshot.prefill_points and not snapshot.decode_points and costs(snapshot) is None


def test_profile_points_seed_the_fits_and_stay_beside_the_live_ones(tmp_path):
    points = [DecodePoint(batch_size=b, context_tokens=b * n, step_ms=10 + 2 * b + 0.01 * b * n)
              for b in (1, 8) for n in (64, 512)]
    decode = WorkerProfile(role="decode", worker="d:1", model="m", kv_capacity_tokens=1000,
                           decode=DecodeCosts.fit(points))
    prefill = WorkerProfile(role="prefill", worker="p:1", model="m", kv_capacity_tokens=0, prefill=prefill_costs())
    decode.save(tmp_path / "d.json")
    prefill.save(tmp_path / "p.json")
    workload = live(profile_points=8, prefill_profile=str(tmp_path / "p.json"),
                    decode_profile=str(tmp_path / "d.json"))
    for i in range(20):
        finish(workload, float(i), 100, 10, 100, 20)
    snapshot = workload.snapshot(now=20.0)
    assert len(snapshot.decode_points) == 4 + 8 and snapshot.decode_profiled
    assert costs(snapshot)[1].ms_per_context_token > 0


def test_a_profile_of_the_wrong_role_is_refused_naming_the_file(tmp_path):
    WorkerProfile(role="prefill", worker="p:1", model="m", kv_capacity_tokens=0,
                  prefill=prefill_costs()).save(tmp_path / "p.json")
    with pytest.raises(ProfileError, match="p.json: a prefill profile, where a decode one is needed"):
        live(decode_profile=str(tmp_path / "p.json"))
