"""The sampler: greedy, seeded reproducibility, top-k and top-p filtering."""

from __future__ import annotations

import torch

from worker.sampling import sample_token
from worker.sequence import SamplingParams

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
