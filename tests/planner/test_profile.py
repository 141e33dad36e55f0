"""Profiles: fits that recover the costs they were measured from, and files that load only as their role."""

from __future__ import annotations

import pytest

from planner.profile import (
    DecodeCosts,
    DecodePoint,
    PrefillCosts,
    PrefillPoint,
    ProfileError,
    WorkerProfile,
    fit_nonnegative,
)
from planner.profiler import new_salts, prompt_ids
from tests.planner.helpers import profiles
from worker.engine.block_pool import BlockPool, BlockTable


def test_prefill_fit_recovers_a_linear_cost_and_the_kv_size_per_token():
    points = [PrefillPoint(prompt_tokens=n, prefill_ms=4 + 0.25 * n, handoff_ms=1 + n * 256 / 2**20,
                           kv_bytes=256 * n) for n in (16, 64, 256, 1024)]
    costs = PrefillCosts.fit(points)
    assert (costs.base_ms, costs.ms_per_token) == pytest.approx((4, 0.25))
    assert (costs.handoff_base_ms, costs.handoff_ms_per_mib, costs.kv_bytes_per_token) == pytest.approx((1, 1, 256))
    assert costs.handoff_ms(2**20 // 256) == pytest.approx(2)


def test_decode_fit_recovers_batch_and_context_costs():
    points = [DecodePoint(batch_size=b, context_tokens=b * c, step_ms=12 + 1.5 * b + 0.002 * b * c)
              for b in (1, 4, 16) for c in (64, 512)]
    costs = DecodeCosts.fit(points)
    assert (costs.base_ms, costs.ms_per_seq, costs.ms_per_context_token) == pytest.approx((12, 1.5, 0.002))


def test_a_term_fitted_negative_is_dropped_so_no_cost_falls_with_load():
    # Steps that do not grow with context, measured with noise that would fit a slightly negative slope.
    rows, values = [[1, 1, 100], [1, 1, 900], [1, 8, 800], [1, 8, 7200]], [17.1, 17.0, 31.1, 31.0]
    base, per_seq, per_context = fit_nonnegative(rows, values)
    assert per_context == 0 and per_seq == pytest.approx(2, abs=0.02) and base == pytest.approx(15, abs=0.1)


def test_profile_round_trips_and_loads_only_as_its_own_role(tmp_path):
    prefill, decode = profiles(kv_capacity_tokens=4096)
    prefill.save(tmp_path / "p.json")
    decode.save(tmp_path / "d.json")
    assert WorkerProfile.load(tmp_path / "p.json", "prefill") == prefill
    assert WorkerProfile.load(tmp_path / "d.json", "decode") == decode
    with pytest.raises(ProfileError, match="a decode profile, where a prefill one is needed"):
        WorkerProfile.load(tmp_path / "d.json", "prefill")


def test_a_profile_without_its_roles_costs_is_refused(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"role": "prefill", "worker": "a:1", "model": "m", "kv_capacity_tokens": 0}')
    with pytest.raises(ProfileError, match=r"p.json: not a worker profile: a prefill profile holds exactly"):
        WorkerProfile.load(path, "prefill")


def test_profile_prompts_of_different_salts_share_no_block_of_a_workers_prefix_cache():
    pool = BlockPool(64, block_size=16)
    salts = new_salts()
    first = prompt_ids(256, next(salts))
    table = BlockTable()
    pool.grow(table, len(first))
    pool.register(table, first, len(first))
    pool.release(table)  # cached now, for any prompt that starts with the same tokens
    assert pool.cached_prefix(first, len(first) - 1, BlockTable()) == 240  # a prompt again: found
    for salt in (next(salts), next(salts) + 100, next(salts) + 100**3):
        again = prompt_ids(256, salt)
        assert len(again) == 256 and 1 <= min(again) and max(again) <= 100  # any vocabulary holds them
        assert pool.cached_prefix(again, 255, BlockTable()) == 0
