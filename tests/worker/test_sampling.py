"""The sampler: greedy, seeded reproducibility, top-k and top-p filtering."""

from __future__ import annotations

import torch

from worker.engine.sampling import apply_penalties, choose, mask_early_stops, sample_token, token_logprobs
from worker.engine.sequence import SamplingParams

LOGITS = torch.tensor([0.1, 2.0, 1.9, -1.0, 0.5, 1.0])


def test_temperature_zero_is_argmax():
    assert sample_token(LOGITS, SamplingParams(temperature=0.0), 0) == 1


def test_same_seed_and_position_give_the_same_token():
    params = SamplingParams(temperature=1.0, seed=77)
    assert len({sample_token(LOGITS, params, 3) for _ in range(20)}) == 1


def test_sampled_tokens_follow_the_distribution():
    counts = torch.zeros(6)
    for seed in range(1, 2001):
        counts[sample_token(LOGITS, SamplingParams(temperature=1.0, seed=seed), 0)] += 1
    expected = torch.softmax(LOGITS, -1) * 2000
    assert torch.all((counts - expected).abs() < 5 * expected.sqrt() + 5)


def test_top_k_keeps_only_the_k_best():
    seen = {sample_token(LOGITS, SamplingParams(temperature=5.0, top_k=2, seed=s), 0) for s in range(1, 300)}
    assert seen == {1, 2}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.softmax(LOGITS, -1)  # 1 and 2 carry about 0.57 together
    p = float(probs[1] + probs[2]) - 0.01
    seen = {sample_token(LOGITS, SamplingParams(temperature=1.0, top_p=p, seed=s), 0) for s in range(1, 300)}
    assert seen == {1, 2}


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    params = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(LOGITS, params, prompt_ids=[1], output_ids=[3])
    assert out[1] == LOGITS[1] / 2 and out[3] == LOGITS[3] * 2
    untouched = [0, 2, 4, 5]
    assert torch.equal(out[untouched], LOGITS[untouched])


def test_presence_and_frequency_penalties_follow_their_definitions_over_output_tokens_only():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(LOGITS, params, prompt_ids=[0], output_ids=[2, 2, 2, 4])
    assert torch.isclose(out[2], LOGITS[2] - 0.5 - 3 * 0.25)
    assert torch.isclose(out[4], LOGITS[4] - 0.5 - 0.25)
    assert out[0] == LOGITS[0]  # a prompt token is not penalised by presence/frequency


def test_negative_presence_penalty_favours_seen_tokens():
    out = apply_penalties(LOGITS, SamplingParams(presence_penalty=-2.0), [], [5])
    assert sample_token(out, SamplingParams(temperature=0.0), 1) == 5


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    params = SamplingParams(min_tokens=2, stop_token_ids=(2,))
    masked = mask_early_stops(LOGITS, params, num_generated=1, eos_ids=[1])
    assert masked[1] == float("-inf") and masked[2] == float("-inf")
    assert torch.equal(mask_early_stops(LOGITS, params, num_generated=2, eos_ids=[1]), LOGITS)


def test_logprobs_are_log_softmax_of_the_raw_logits():
    lp = token_logprobs(LOGITS, token=4, top=3)
    ref = torch.log_softmax(LOGITS, -1)
    assert abs(lp.logprob - float(ref[4])) < 1e-6
    assert [t for t, _ in lp.top] == [1, 2, 5]
    assert all(abs(v - float(ref[t])) < 1e-6 for t, v in lp.top)


def test_choose_reports_logprobs_of_the_unpenalised_distribution():
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, return_logprobs=True, top_logprobs=1)
    token, lp = choose(LOGITS, params, prompt_ids=[1], output_ids=[], eos_ids=[])
    assert token == 2  # 1 was penalised below 2
    assert abs(lp.logprob - float(torch.log_softmax(LOGITS, -1)[2])) < 1e-6
