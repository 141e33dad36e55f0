"""ServiceTimes: a request's expected time from its turn to its end, with a margin, from finished requests."""

from __future__ import annotations

import pytest

from coordinator.requests.attempt import Progress
from coordinator.requests.pipeline import ServiceTimes


def finished(started: float, first_after_s: float, tokens: int, gap_s: float) -> Progress:
    progress = Progress(token_ids=list(range(tokens)))
    progress.first_at = started + first_after_s
    progress.last_at = progress.first_at + gap_s * (tokens - 1)
    return progress


def test_nothing_finished_expects_no_service_time():
    assert ServiceTimes().expected_s(100) == 0.0


def test_steady_requests_give_their_own_service_time_capped_by_max_tokens():
    times = ServiceTimes()
    for i in range(20):
        times.observe(100.0 * i, finished(100.0 * i, 0.2, 11, 0.05))
    assert times.deviation_s == pytest.approx(0.0, abs=1e-9)
    assert times.expected_s(1000) == pytest.approx(0.2 + 10 * 0.05)  # as long as the requests seen
    assert times.expected_s(3) == pytest.approx(0.2 + 2 * 0.05)  # a shorter cap, a shorter service


def test_requests_that_stray_widen_the_margin():
    times = ServiceTimes()
    for i in range(40):
        times.observe(100.0 * i, finished(100.0 * i, 0.2 if i % 2 else 0.6, 11, 0.05))
    mean = times.first_token_s + 10 * times.token_s
    assert times.deviation_s > 0.1
    assert times.expected_s(1000) == pytest.approx(mean + 2 * times.deviation_s)
    assert times.expected_s(1000) >= 0.6 + 10 * 0.05  # the slow half fits in the margin


def test_a_request_that_produced_nothing_teaches_nothing():
    times = ServiceTimes()
    times.observe(0.0, Progress())
    assert times.seen == 0
