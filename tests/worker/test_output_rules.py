"""Per-sequence stopping rules: EOS, ignore_eos, stop tokens, stop strings kept or cut."""

from __future__ import annotations

import pytest

from worker.engine.output import OutputProcessor
from worker.engine.sequence import SamplingParams, Sequence, StopCause


@pytest.fixture(scope="module")
def tokenizer(hf_model):
    return hf_model[1]


def run(tokenizer, ids: list[int], **params) -> list:
    seq = Sequence("r", 4, SamplingParams(max_tokens=100, **params), max_seq_len=1000)
    processor = OutputProcessor(seq, tokenizer, frozenset({tokenizer.eos_token_id}))
    outputs = []
    for i in ids:
        outputs.append(processor.append(i, 1.0))
        if outputs[-1].finish_reason is not None:
            break
    return outputs


def test_eos_ends_the_sequence(tokenizer):
    ids = tokenizer("Hello there")["input_ids"] + [tokenizer.eos_token_id, 50]
    outputs = run(tokenizer, ids)
    assert outputs[-1].finish_reason is StopCause.EOS and outputs[-1].token_id == tokenizer.eos_token_id


def test_ignore_eos_keeps_going_past_eos(tokenizer):
    ids = tokenizer("Hello")["input_ids"] + [tokenizer.eos_token_id, 50, 51]
    outputs = run(tokenizer, ids, ignore_eos=True)
    assert len(outputs) == len(ids) and all(o.finish_reason is None for o in outputs)


def test_stop_token_ends_the_sequence_without_its_text(tokenizer):
    ids = tokenizer("The coordinator sends the prompt")["input_ids"]
    outputs = run(tokenizer, ids, stop_token_ids=(ids[2],))
    assert len(outputs) == 3 and outputs[-1].finish_reason is StopCause.STOP_TOKEN
    assert outputs[-1].matched_stop == str(ids[2])
    assert "".join(o.text for o in outputs) == tokenizer.decode(ids[:2])


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer):
    text = "The coordinator sends the prompt"
    ids = tokenizer(text)["input_ids"]
    cut = run(tokenizer, ids, stop=("sends",))
    kept = run(tokenizer, ids, stop=("sends",), include_stop_str_in_output=True)
    assert "".join(o.text for o in cut) == "The coordinator "
    assert "".join(o.text for o in kept) == "The coordinator sends"
    assert kept[-1].finish_reason is StopCause.STOP_STRING


@pytest.mark.parametrize("text", ["naïve café", "日本語のテキスト", "emoji 😀 ok"])
@pytest.mark.parametrize("end", ["length", "eos"])
def test_an_output_ending_inside_a_character_equals_the_decode_of_all_its_ids(tokenizer, text, end):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    cut = next(k for k in range(1, len(ids) + 1) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    generated = ids[:cut] + ([tokenizer.eos_token_id] if end == "eos" else [])
    seq = Sequence("r", 4, SamplingParams(max_tokens=cut if end == "length" else 100), max_seq_len=1000)
    processor = OutputProcessor(seq, tokenizer, frozenset({tokenizer.eos_token_id}))
    outputs = [processor.append(i, 1.0) for i in generated]
    assert outputs[-1].finish_reason is (StopCause.LENGTH if end == "length" else StopCause.EOS)
    assert "".join(o.text for o in outputs) == tokenizer.decode(generated, skip_special_tokens=True)
