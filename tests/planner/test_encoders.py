"""The planner's encode count: the window's encode seconds at 70% busy, never below one while encode workers run,
none where none do; up at once, down by one after the count has stood low for scale_down_after_s."""

from __future__ import annotations

from planner.encoders import TARGET_UTILIZATION, EncoderDemand
from planner.settings import PlannerConfig

CONFIG = PlannerConfig(enabled=True, window_s=10, scale_down_after_s=30)


def test_no_encode_workers_means_none_are_asked_for_whatever_the_images():
    demand = EncoderDemand(CONFIG)
    demand.record(1.0, 50.0, 100)
    assert demand.decide(2.0, current=0, room=8) == 0


def test_the_windows_busy_share_over_the_target_utilisation_is_the_count_asked_for_at_once():
    demand = EncoderDemand(CONFIG)
    assert demand.decide(0.0, current=1, room=8) == 1  # idle: one stays
    for t in range(10):
        demand.record(t + 0.5, 1.5, 3)  # 1.5 s of encoding per second of the window
    assert demand.busy_share(10.0) == 1.5
    assert demand.decide(10.0, current=1, room=8) == 3 == -(-1.5 // TARGET_UTILIZATION)


def test_the_count_is_bounded_by_the_room_the_cluster_has():
    demand = EncoderDemand(CONFIG)
    demand.record(1.0, 60.0, 40)
    assert demand.decide(2.0, current=1, room=2) == 3


def test_calls_older_than_the_window_leave_it_and_the_count_comes_down_one_at_a_time_after_the_wait():
    demand = EncoderDemand(CONFIG)
    demand.record(1.0, 20.0, 10)
    assert demand.decide(2.0, current=1, room=8) == 3
    assert demand.decide(20.0, current=3, room=6) == 3  # the window is empty now: lower, but not yet
    assert demand.decide(49.0, current=3, room=6) == 3
    assert demand.decide(50.0, current=3, room=6) == 2
    assert demand.decide(60.0, current=2, room=6) == 2  # the wait starts again for the next step down
    assert demand.decide(89.0, current=2, room=6) == 2
    assert demand.decide(90.0, current=2, room=6) == 1
    assert demand.decide(200.0, current=1, room=6) == 1  # never below one while encode workers run
