"""The cluster model: timings a hand computation gives, batching, queueing, routing and the KV budget."""

from __future__ import annotations

import pytest

from planner.simulation import ClusterModel, SimulationError, WorkerSettings, simulate
from tests.planner.helpers import decode_costs, make_requests, prefill_costs


def cluster(num_prefill: int = 1, num_decode: int = 1, **kwargs) -> ClusterModel:
    costs = {"prefill": prefill_costs(handoff_ms=3.0), "decode": decode_costs()}
    costs.update({k: kwargs.pop(k) for k in ("prefill", "decode") if k in kwargs})
    return ClusterModel(num_prefill=num_prefill, num_decode=num_decode, **costs, **kwargs)


def test_lone_request_ttft_is_its_prefill_plus_handoff_and_tpot_the_step_time_at_its_context():
    model = cluster(decode=decode_costs(ms_per_context_token=0.01))
    [timing] = simulate(model, make_requests((0.0, 200, 10))).timings
    assert timing.ttft_ms == pytest.approx(10 + 0.1 * 200 + 3)
    # Each of the 9 steps after the first token runs one sequence holding 200 + g positions, g = 1..9.
    assert timing.tpot_ms == pytest.approx(sum(15 + 2 + 0.01 * (200 + g) for g in range(1, 10)) / 9)


def test_requests_prefilled_together_decode_as_one_batch_at_that_batch_size_step_time():
    result = simulate(cluster(), make_requests(*[(0.0, 100, 20)] * 8))
    assert {round(t.ttft_ms, 6) for t in result.timings} == {round(10 + 0.1 * 800 + 3, 6)}  # one padded forward
    assert [t.tpot_ms for t in result.timings] == pytest.approx([15 + 2 * 8] * 8)
    assert result.mean_decode_batch == pytest.approx(8)


def test_max_running_keeps_later_sequences_out_of_the_batch_until_a_seat_frees():
    result = simulate(cluster(settings=WorkerSettings(max_running=4)), make_requests(*[(0.0, 100, 20)] * 8))
    tpots = [t.tpot_ms for t in result.timings]
    assert tpots[:4] == pytest.approx([15 + 2 * 4] * 4)
    assert min(tpots[4:]) > 2 * (15 + 2 * 4)  # waited 19 steps of the first four before their own
    assert result.mean_decode_batch == pytest.approx(4)


def test_ttft_grows_over_the_run_only_when_arrivals_outpace_prefill():
    # One 1000-token prompt per forward (110 ms): about 9 per second at most.
    settings = WorkerSettings(max_prefill_tokens=1000)

    def ttfts(rate: float) -> list[float]:
        rows = [(i / rate, 1000, 2) for i in range(40)]
        return [t.ttft_ms for t in simulate(cluster(settings=settings), make_requests(*rows)).timings]

    under = ttfts(5)
    assert max(under) == pytest.approx(10 + 100 + 3)
    over = ttfts(20)
    assert over[0] == pytest.approx(113) and over[-1] > 10 * over[0]
    assert over == sorted(over)  # the queue only lengthens


def test_load_balance_routes_to_the_prefill_instance_with_fewer_queued_tokens():
    # A long prompt, then two short ones: the second short one shares the idle instance, not the long one's.
    rows = [(0.0, 4000, 2), (0.001, 10, 2), (0.002, 10, 2)]
    settings = WorkerSettings(max_prefill_batch_size=1)
    balanced = simulate(cluster(2, 1, settings=settings, policy="load_balance"), make_requests(*rows)).timings
    in_turn = simulate(cluster(2, 1, settings=settings, policy="round_robin"), make_requests(*rows)).timings
    assert balanced[2].ttft_ms < 30
    assert in_turn[2].ttft_ms > 10 + 0.1 * 4000 - 2  # behind the long prompt


def test_decode_kv_budget_holds_a_request_until_an_earlier_one_frees_its_reservation():
    rows = [(0.0, 100, 50), (0.0, 100, 50)]  # 150 positions each, 200 fit
    timings = simulate(cluster(decode_kv_capacity_tokens=200), make_requests(*rows)).timings
    first_done_ms = timings[0].ttft_ms + 49 * timings[0].tpot_ms
    assert timings[1].ttft_ms > first_done_ms


def test_a_request_over_the_decode_kv_budget_is_an_error_naming_both_sizes():
    with pytest.raises(SimulationError, match=r"100 prompt \+ 50 output.*\(120 tokens\)"):
        simulate(cluster(decode_kv_capacity_tokens=120), make_requests((0.0, 100, 50)))
