"""logit_bias: added after penalties and before masks; +100 forces, -100 bans; ids outside the vocabulary refused."""

from __future__ import annotations

import llguidance
import pytest
import torch

from worker.engine.errors import InvalidRequest
from worker.torch_engine.grammar_masks import Guidance
from worker.torch_engine.sampling import apply_logit_bias, choose, choose_batch, process_logits
from worker.engine.sequence import SamplingParams
from worker.engine.sequence import Sequence as EngineSequence

VOCAB, EOS = 1224, 2
RAW = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)) * 4


@pytest.fixture(scope="module")
def guidance(tokenizer):
    return Guidance(tokenizer, VOCAB, [EOS])


def test_biases_are_added_to_the_named_logits_only():
    out = apply_logit_bias(RAW, SamplingParams(logit_bias=((7, 2.5), (9, -1.0))))
    assert out[7] == RAW[7] + 2.5 and out[9] == RAW[9] - 1.0
    untouched = torch.ones(VOCAB, dtype=torch.bool)
    untouched[[7, 9]] = False
    assert torch.equal(out[untouched], RAW[untouched])
    assert apply_logit_bias(RAW, SamplingParams()) is RAW  # nothing to add: no copy


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 3}, {"temperature": 2.0, "seed": 8, "top_p": 0.9}])
def test_plus_100_forces_a_token_and_minus_100_bans_one(sampling):
    forced = int(RAW.argmin())
    params = SamplingParams(logit_bias=((forced, 100.0),), **sampling)
    assert all(choose(RAW, params, [], [0] * i, [EOS])[0] == forced for i in range(20))
    favourite = int(RAW.argmax())
    banned = SamplingParams(logit_bias=((favourite, -100.0),), **sampling)
    assert all(choose(RAW, banned, [], [0] * i, [EOS])[0] != favourite for i in range(20))


def test_the_bias_comes_after_the_penalties():
    token = int(RAW.argmax())
    params = SamplingParams(repetition_penalty=2.0, logit_bias=((token, 1.0),))
    out = process_logits(RAW, params, prompt_ids=[token], output_ids=[], eos_ids=[EOS])
    assert out[token] == pytest.approx(float(RAW[token]) / 2 + 1.0)  # penalised first, then biased


def test_the_grammar_mask_comes_after_the_bias(guidance, tokenizer):
    letter = tokenizer.convert_tokens_to_ids("F")
    params = SamplingParams(grammar=llguidance.LLMatcher.grammar_from_regex(r"[0-9]+"),
                            logit_bias=((letter, 100.0),))
    seq = EngineSequence("r", 3, params, 64, prompt_token_ids=[5, 6, 7])
    seq.matcher = guidance.matcher(params)
    (token, _), = choose_batch(RAW.unsqueeze(0), [seq], [EOS], guidance.masks)
    assert token != letter and tokenizer.decode([token]).isdigit()


@pytest.mark.parametrize("bias,message", [
    (((VOCAB, 1.0),), f"logit_bias names token id {VOCAB}, outside the model's vocabulary [0, {VOCAB})"),
    (((-1, 1.0),), "logit_bias names token id -1"),
    (((5, 150.0),), "logit_bias of token id 5 is 150.0; it must be in [-100, 100]"),
    (((5, float("nan")),), "logit_bias of token id 5 is nan"),
    (tuple((i, 1.0) for i in range(301)), "logit_bias has 301 entries; at most 300 are allowed"),
])
def test_a_bias_outside_the_vocabulary_or_the_range_is_an_invalid_request(guidance, bias, message):
    with pytest.raises(InvalidRequest) as refused:
        guidance.check(SamplingParams(logit_bias=bias))
    assert str(refused.value).startswith(message)
