"""A step's grammar masks: computed together, applied in one fill, sampling inside them, the grammar winning."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import llguidance
import pytest
import torch

from worker.torch_engine.grammar_masks import Guidance
from worker.torch_engine.sampling import choose, choose_batch
from worker.engine.sequence import SamplingParams

VOCAB, EOS = 1224, 2
DIGITS = llguidance.LLMatcher.grammar_from_regex(r"[0-9]{2,4}")
COLOR = llguidance.LLMatcher.grammar_from_lark('start: "red" | "green" | "blue"')


@dataclass
class Row:
    """What choose_batch reads of a Sequence or a PrefillJob."""

    sampling: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=lambda: [5, 6, 7])
    matcher: Any = None


@pytest.fixture(scope="module")
def guidance(tokenizer):
    return Guidance(tokenizer, VOCAB, [EOS])


def guided_row(guidance, grammar: str, **sampling) -> Row:
    params = SamplingParams(grammar=grammar, **sampling)
    return Row(params, matcher=guidance.matcher(params))


def reference_banned(matcher) -> torch.Tensor:
    bits = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
    allowed = ((bits.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()[:VOCAB]
    return allowed == 0


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_the_masks_of_a_step_equal_each_matchers_own_bitmask(guidance, tokenizer):
    matchers = [guidance.matcher(SamplingParams(grammar=g)) for g in (DIGITS, COLOR, DIGITS)]
    matchers[2].consume_tokens(tokenizer("12", add_special_tokens=False)["input_ids"])
    banned = guidance.masks.banned(matchers)
    assert banned.shape == (3, VOCAB) and banned.dtype == torch.bool
    for row, matcher in enumerate(matchers):
        assert torch.equal(banned[row], reference_banned(matcher))
        assert torch.equal(guidance.masks.banned([matcher])[0], reference_banned(matcher))  # a step of one row


def test_eos_is_allowed_only_where_the_grammar_accepts(guidance, tokenizer):
    matcher = guidance.matcher(SamplingParams(grammar=DIGITS))
    assert guidance.masks.banned([matcher])[0, EOS]
    matcher.consume_tokens(tokenizer("12", add_special_tokens=False)["input_ids"])
    assert not guidance.masks.banned([matcher])[0, EOS]


def test_unconstrained_rows_sample_as_alone_and_guided_rows_stay_inside_their_grammar(guidance):
    raw = logits(4)
    plain = [Row(SamplingParams()), Row(SamplingParams(temperature=1.0, seed=9, top_k=50))]
    guided = [guided_row(guidance, DIGITS), guided_row(guidance, COLOR, temperature=0.8, seed=3, top_p=0.9)]
    rows = [plain[0], guided[0], plain[1], guided[1]]
    allowed = [~reference_banned(row.matcher) for row in guided]
    picks = choose_batch(raw, rows, [EOS], guidance.masks)
    for i, row in ((0, plain[0]), (2, plain[1])):
        assert picks[i] == choose(raw[i], row.sampling, row.prompt_token_ids, [], [EOS])
    for i, mask in ((1, allowed[0]), (3, allowed[1])):
        assert mask[picks[i][0]]
    assert picks[1][0] == int(raw[1].masked_fill(~allowed[0], float("-inf")).argmax())  # greedy inside the mask


def test_every_chosen_token_is_consumed_and_greedy_rows_follow_the_grammar_to_its_end(guidance, tokenizer):
    row = guided_row(guidance, COLOR, max_tokens=20)
    for step in range(20):
        (token, _), = choose_batch(logits(1, seed=step), [row], [EOS], guidance.masks)
        if token == EOS:
            break
        row.output_token_ids.append(token)
    assert tokenizer.decode(row.output_token_ids) in ("red", "green", "blue")
    assert row.matcher.is_stopped()


def test_seeded_sampling_inside_a_mask_is_reproducible(guidance):
    raw = logits(1, seed=4)
    tokens = {choose_batch(raw, [guided_row(guidance, DIGITS, temperature=1.5, seed=7)], [EOS], guidance.masks)[0][0]
              for _ in range(5)}
    assert len(tokens) == 1


def test_logprobs_of_a_guided_row_are_those_of_the_raw_distribution(guidance):
    raw = logits(1, seed=5)
    row = guided_row(guidance, COLOR, return_logprobs=True, top_logprobs=3)
    (token, lp), = choose_batch(raw, [row], [EOS], guidance.masks)
    expected = torch.log_softmax(raw[0], -1)
    assert lp.logprob == pytest.approx(float(expected[token]), abs=1e-5)
    assert [t for t, _ in lp.top] == torch.topk(expected, 3).indices.tolist()  # unmasked alternatives


def test_when_min_tokens_bans_all_the_grammar_allows_the_grammar_wins(guidance, tokenizer):
    for sampling in ({}, {"temperature": 1.0, "seed": 1, "top_k": 5, "top_p": 0.5}):
        row = guided_row(guidance, COLOR, min_tokens=10, **sampling)
        row.output_token_ids = tokenizer("red", add_special_tokens=False)["input_ids"]
        row.matcher.consume_tokens(row.output_token_ids)
        (token, _), = choose_batch(logits(1, seed=6), [row], [EOS], guidance.masks)
        assert token == EOS  # the only token the grammar allows; never a sample from an all -inf row


def test_min_tokens_still_bans_eos_where_the_grammar_allows_more(guidance, tokenizer):
    row = guided_row(guidance, DIGITS, min_tokens=10)
    row.output_token_ids = tokenizer("12", add_special_tokens=False)["input_ids"]
    row.matcher.consume_tokens(row.output_token_ids)
    raw = logits(1)
    raw[0, EOS] = 50.0
    (token, _), = choose_batch(raw, [row], [EOS], guidance.masks)
    assert token != EOS and tokenizer.decode([token]).isdigit()


def test_a_row_whose_matcher_failed_gets_no_token_and_the_others_do(guidance):
    broken = guided_row(guidance, DIGITS)
    broken.matcher.consume_token(EOS)  # EOS before any digit: the matcher is now in error
    picks = choose_batch(logits(2), [broken, guided_row(guidance, DIGITS)], [EOS], guidance.masks)
    assert picks[0] is None and picks[1] is not None


def test_the_mask_buffers_grow_for_a_larger_step_and_are_reused(guidance):
    rows = [guided_row(guidance, DIGITS) for _ in range(20)]
    picks = choose_batch(logits(20), rows, [EOS], guidance.masks)
    buffer = guidance.masks._banned
    choose_batch(logits(20, seed=1), [guided_row(guidance, COLOR) for _ in range(3)], [EOS], guidance.masks)
    assert guidance.masks._banned is buffer and all(p is not None for p in picks)


def test_a_guided_requests_check_loads_the_mask_kernel_and_an_unguided_ones_does_not(guidance, monkeypatch):
    # Loading compiles a kernel; a prefill paying it between its last KV layer and its first token stalled the
    # decode worker's receiver under load, so the check (before any transfer) must pay it.
    loads = []
    monkeypatch.setattr(type(guidance.masks), "load_kernel", staticmethod(lambda: loads.append(1)))
    guidance.check(SamplingParams())
    assert loads == []
    guidance.check(SamplingParams(grammar=DIGITS))
    assert loads == [1]
