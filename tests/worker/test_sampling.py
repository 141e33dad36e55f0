"""The sampler: greedy, seeded reproducibility, top-k, top-p and typical-p filtering."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from transformers.generation.logits_process import TypicalLogitsWarper

from worker.torch_engine.sampling import (
    PenaltyCounts,
    apply_penalties,
    batch_logprobs,
    choose,
    choose_batch,
    mask_early_stops,
    sample_batch,
    sample_token,
    sampling_probs,
    token_logprobs,
    typical_filter,
)
from worker.engine.sequence import SamplingParams, Sequence

LOGITS = torch.tensor([0.1, 2.0, 1.9, -1.0, 0.5, 1.0])
WIDE = torch.randn(1224, generator=torch.Generator().manual_seed(12)) * 3


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


@pytest.mark.parametrize("mass", [0.05, 0.2, 0.5, 0.9, 0.95, 0.999])
def test_typical_filter_keeps_exactly_the_tokens_hf_typical_warper_keeps(mass):
    logits = torch.randn(16, 1224, generator=torch.Generator().manual_seed(int(mass * 1000))) * 3
    logits[::4] = (logits[::4] * 2).round() / 2  # ties in the distance to the entropy
    logits[1::4, 600:] = float("-inf")  # rows a grammar mask, top-k or top-p already cut
    logits[2] = torch.cat([torch.tensor([12.0]), torch.zeros(1223)])  # one token carries nearly all the mass
    expected = TypicalLogitsWarper(mass=mass)(None, logits.clone())
    kept = typical_filter(logits, torch.full((16, 1), mass))
    assert torch.equal(torch.isfinite(kept), torch.isfinite(expected))
    assert torch.equal(kept[torch.isfinite(kept)], logits[torch.isfinite(kept)])


def test_typical_filter_gives_each_row_its_own_mass():
    logits = torch.randn(3, 1224, generator=torch.Generator().manual_seed(9)) * 3
    masses = [0.3, 0.7, 0.95]
    kept = typical_filter(logits, torch.tensor(masses).unsqueeze(1))
    for row, mass in enumerate(masses):
        expected = TypicalLogitsWarper(mass=mass)(None, logits[row : row + 1].clone())
        assert torch.equal(torch.isfinite(kept[row : row + 1]), torch.isfinite(expected))


def test_typical_p_applies_after_temperature_top_k_and_top_p_as_hf_generate_orders_them():
    logits = torch.randn(1, 1224, generator=torch.Generator().manual_seed(10)) * 3
    params = SamplingParams(temperature=0.7, top_k=300, typical_p=0.6, seed=1)
    probs = sampling_probs(logits, [params])
    scores = logits / torch.tensor([0.7])
    scores = scores.masked_fill(scores < torch.topk(scores, 300).values[:, -1:], float("-inf"))
    expected = TypicalLogitsWarper(mass=0.6)(None, scores)
    assert torch.equal(probs > 0, torch.isfinite(expected))


@pytest.mark.parametrize("off", [1.0, 0.0])  # 1.0: off; 0.0: a message that left it out
def test_rows_without_typical_p_are_untouched_by_rows_with_it(off):
    rng = random.Random(6)
    logits = torch.randn(12, 1224, generator=torch.Generator().manual_seed(3)) * 3
    plain = [mixed_params(rng) for _ in range(12)]
    plain = [p if p.temperature else SamplingParams(temperature=1.0, seed=1) for p in plain]
    plain = [dataclasses.replace(p, typical_p=off) for p in plain]
    mixed = [dataclasses.replace(p, typical_p=0.4) if i % 3 == 0 else p for i, p in enumerate(plain)]
    untouched = [i for i in range(12) if i % 3]
    assert torch.equal(sampling_probs(logits, mixed)[untouched], sampling_probs(logits, plain)[untouched])
    filtered = sampling_probs(logits, mixed)[::3]
    assert torch.equal(filtered, sampling_probs(logits[::3], mixed[::3]))  # each typical row as it is alone
    assert bool(((filtered > 0).sum(-1) < (sampling_probs(logits, plain)[::3] > 0).sum(-1)).any())


def test_greedy_ignores_typical_p():
    assert sample_token(LOGITS, SamplingParams(temperature=0.0, typical_p=0.2), 0) == 1


def test_a_seeded_typical_request_draws_only_typical_tokens_and_the_same_ones_again():
    params = SamplingParams(temperature=1.0, typical_p=0.3, seed=11)
    allowed = torch.isfinite(TypicalLogitsWarper(mass=0.3)(None, WIDE.unsqueeze(0).clone()))[0]
    tokens = [sample_token(WIDE, params, i) for i in range(30)]
    assert all(allowed[t] for t in tokens)
    assert tokens == [sample_token(WIDE, params, i) for i in range(30)]


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


# Tokens the row-by-row sampler drew before sampling was batched: a seed must keep drawing them.
@pytest.mark.parametrize("params,tokens", [
    (SamplingParams(temperature=1.0, seed=7), [1052, 193, 1132, 1179, 753, 1132]),
    (SamplingParams(temperature=0.7, seed=123456789, top_k=40), [1179, 1179, 1054, 753, 269, 1132]),
    (SamplingParams(temperature=1.3, seed=5, top_p=0.9), [273, 466, 1179, 551, 1132, 1132]),
    (SamplingParams(temperature=0.9, seed=2**40 + 3, top_k=100, top_p=0.8), [1179, 1179, 257, 49, 351, 753]),
])
def test_a_seed_draws_the_same_tokens_as_before_sampling_was_batched(params, tokens):
    assert [sample_token(WIDE, params, i) for i in range(6)] == tokens


def mixed_params(rng: random.Random) -> SamplingParams:
    if rng.random() < 0.3:
        return SamplingParams()
    return SamplingParams(temperature=rng.choice([0.3, 0.8, 1.0, 1.7]), seed=rng.randrange(1, 2**40),
                          top_k=rng.choice([0, 0, 1, 5, 200]), top_p=rng.choice([1.0, 1.0, 0.5, 0.9, 0.99]))


def test_each_row_of_a_batch_gets_the_token_it_gets_alone():
    rng = random.Random(4)
    logits = torch.randn(40, 1224, generator=torch.Generator().manual_seed(1)) * 3
    logits[::7] = (logits[::7] * 2).round() / 2  # ties
    params = [mixed_params(rng) for _ in range(40)]
    indices = [rng.randrange(100) for _ in range(40)]
    assert sample_batch(logits, params, indices) == [sample_token(logits[i], p, n)
                                                     for i, (p, n) in enumerate(zip(params, indices))]


def test_batched_logprobs_equal_each_rows_own():
    logits = torch.randn(5, 1224, generator=torch.Generator().manual_seed(2))
    tokens, tops = [3, 70, 0, 1223, 9], [0, 1, 5, 20, 2]
    assert batch_logprobs(logits, tokens, tops) == [token_logprobs(logits[i], t, k)
                                                    for i, (t, k) in enumerate(zip(tokens, tops))]


def test_penalty_counts_kept_across_steps_equal_a_recount_of_the_whole_history():
    rng = random.Random(5)
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2)
    prompt = [rng.randrange(1224) for _ in range(8)]
    counts, output = PenaltyCounts(prompt, 1224), []
    for step in range(30):
        output += [rng.choice(prompt + output + [rng.randrange(1224)]) for _ in range(step % 3)]  # repeats, new ids
        counts.update(output)
        recounted = apply_penalties(WIDE, params, prompt, output)
        assert torch.equal(apply_penalties(WIDE, params, prompt, output, counts), recounted)


def test_a_sequence_keeps_its_penalty_counts_and_samples_as_a_recount_would():
    params = SamplingParams(temperature=1.0, seed=3, repetition_penalty=1.5, frequency_penalty=0.5)
    seq = Sequence("r", 3, params, 1000, prompt_token_ids=[5, 6, 7])
    for step in range(20):
        raw = torch.randn(1, 1224, generator=torch.Generator().manual_seed(step)) * 3
        (token, _), = choose_batch(raw, [seq], [2], None)
        assert token == choose(raw[0], params, seq.prompt_token_ids, seq.output_token_ids, [2])[0]
        seq.output_token_ids.append(token)
    assert seq.penalties.num_counted == 19
