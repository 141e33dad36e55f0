"""The cluster model: timings a hand computation gives, chunked prefill, batching, queueing, routing, and decode
admission, growth and preemption over the KV block pool."""

from __future__ import annotations

import pytest

from planner.simulation import ClusterModel, SimulationError, SimulationStalled, WorkerSettings, simulate
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
    assert {round(t.ttft_ms, 6) for t in result.timings} == {round(10 + 0.1 * 800 + 3, 6)}  # one forward, 800 tokens
    assert [t.tpot_ms for t in result.timings] == pytest.approx([15 + 2 * 8] * 8)
    assert result.mean_decode_batch == pytest.approx(8)


def test_a_forward_costs_the_tokens_it_computes_not_the_batch_padded_to_its_longest_prompt():
    timings = simulate(cluster(), make_requests((0.0, 100, 2), (0.0, 20, 2))).timings
    assert [t.ttft_ms for t in timings] == pytest.approx([10 + 0.1 * 120 + 3] * 2)  # padded: 10 + 0.1 x 200 + 3


def test_a_prompt_over_max_prefill_tokens_is_prefilled_in_chunks_and_a_younger_one_fills_the_last():
    timings = simulate(cluster(), make_requests((0.0, 3000, 2), (0.001, 100, 2))).timings
    # Forward 1: the long prompt's first 2048 tokens; forward 2: its last 952 and the short prompt's 100.
    done_ms = (10 + 0.1 * 2048) + (10 + 0.1 * (952 + 100))
    assert [t.ttft_ms for t in timings] == pytest.approx([done_ms + 3, done_ms + 3 - 1])


def test_requests_share_no_prefix_so_a_prompt_of_a_length_seen_before_is_computed_again():
    timings = simulate(cluster(), make_requests((0.0, 160, 2), (1.0, 160, 2))).timings
    assert [t.ttft_ms for t in timings] == pytest.approx([10 + 0.1 * 160 + 3] * 2)


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


def test_decode_admission_holds_a_request_until_the_kv_budget_holds_its_prompt_and_first_token():
    model = cluster(decode_kv_capacity_tokens=256)
    # 128 + 128 positions fit: both are admitted and prefilled in one forward.
    together = simulate(model, make_requests((0.0, 127, 2), (0.0, 127, 2))).timings
    assert [t.ttft_ms for t in together] == pytest.approx([10 + 0.1 * 254 + 3] * 2)
    # 129 + 129 do not: the second is admitted when the first ends, after its one decode step.
    held = simulate(model, make_requests((0.0, 128, 2), (0.0, 128, 2))).timings
    first_done_ms = 10 + 0.1 * 128 + 3 + 15 + 2
    assert held[0].ttft_ms == pytest.approx(first_done_ms - 17)
    assert held[1].ttft_ms == pytest.approx(first_done_ms + 10 + 0.1 * 128 + 3)


def test_sequences_admitted_by_their_prompts_that_outgrow_the_pool_preempt_the_youngest_which_is_recomputed():
    # 256 positions are 16 blocks of 16. Both are admitted (101 + 101 positions, though their outputs would take
    # 159 each) and prefilled together; each holds 8 blocks by its 13th token, and at its 29th needs a 9th.
    result = simulate(cluster(decode_kv_capacity_tokens=256), make_requests((0.0, 100, 60), (0.0, 100, 60)))
    first, second = result.timings
    assert first.ttft_ms == second.ttft_ms == pytest.approx(10 + 0.1 * 200 + 3)
    assert result.preemptions == 1
    # The second is preempted, so the first makes tokens 2-29 in steps of both and 30-60 alone.
    assert first.tpot_ms == pytest.approx((28 * (15 + 2 * 2) + 31 * (15 + 2)) / 59)
    # The second's 8 blocks are released and stay cached; the first's 9th and 10th blocks evict its last two. When
    # the first ends, its recomputation finds its first 6 blocks cached and computes the other 32 of its 128
    # positions (prompt and output but the last token), then it makes tokens 30-60 alone.
    recompute_ms = 10 + 0.1 * (128 - 6 * 16)
    assert second.tpot_ms == pytest.approx((28 * (15 + 2 * 2) + 31 * (15 + 2) + recompute_ms + 31 * (15 + 2)) / 59)


def test_preempted_sequences_whose_recomputations_fill_the_pool_between_them_still_finish():
    # 16 blocks. The two younger ones are preempted while the first runs; when it ends, their recomputations (144
    # and 102 positions, each holding its next token's block from the start) need 10 + 7 blocks between them: the
    # younger waits for the older to finish instead of both stalling a block short.
    rows = [(0.0, 75, 98), (0.0, 116, 138), (0.0, 61, 64)]
    assert len(simulate(cluster(decode_kv_capacity_tokens=256), make_requests(*rows)).timings) == 3


def test_a_request_over_the_decode_kv_budget_is_an_error_naming_both_sizes():
    with pytest.raises(SimulationError, match=r"100 prompt \+ 50 output.*\(120 tokens\)"):
        simulate(cluster(decode_kv_capacity_tokens=120), make_requests((0.0, 100, 50)))
