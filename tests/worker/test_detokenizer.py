"""Incremental detokenizing and stop-string hold-back."""

from __future__ import annotations

import random

import pytest

from worker.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher


def test_incremental_text_equals_full_decode_with_multibyte_characters(tokenizer):
    text = "Grüße, 世界! naïve café ☕ done"
    ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_split_across_deltas_is_held_then_cut():
    m = StopStringMatcher(("STOP",))
    assert m.feed("abc S") == "abc "
    assert m.feed("T") == ""
    assert m.feed("OP tail") == ""
    assert m.stopped and m.matched == "STOP"


def test_held_text_is_released_when_the_match_fails():
    m = StopStringMatcher(("STOP",))
    assert m.feed("xx ST") == "xx "
    assert m.feed("ay") == "STay"
    assert not m.stopped


def test_earliest_of_several_stop_strings_wins():
    m = StopStringMatcher(("world", "lo w"))
    assert m.feed("hello world") == "hel"
    assert m.matched == "lo w"


def test_flush_releases_held_text_at_the_end():
    m = StopStringMatcher(("END",))
    assert m.feed("the E") == "the "
    assert m.flush() == "E"


def test_no_stop_strings_passes_text_through():
    assert StopStringMatcher(()).feed("anything") == "anything"


class PythonOnly:
    """The same tokenizer behind a plain object, so the detokenizer decodes its window in Python."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


@pytest.mark.parametrize("skip", [True, False])
def test_the_rust_stream_emits_exactly_what_the_python_window_does_and_ends_on_the_full_decode(tokenizer, skip):
    rng = random.Random(0)
    special = tokenizer.all_special_ids
    for _ in range(200):
        # Random ids: partial UTF-8 characters, invalid byte runs and special tokens, in any order.
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tokenizer))
               for _ in range(rng.randrange(1, 40))]
        rust, python = IncrementalDetokenizer(tokenizer, skip), IncrementalDetokenizer(PythonOnly(tokenizer), skip)
        pieces = [rust.push(i) for i in ids]
        assert pieces == [python.push(i) for i in ids]
        tail = rust.flush()
        assert tail == python.flush()
        assert "".join(pieces) + tail == tokenizer.decode(ids, skip_special_tokens=skip)


def test_a_fast_tokenizer_decodes_in_rust_until_the_flush(tokenizer, monkeypatch):
    calls = []
    decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda *a, **k: calls.append(a) or decode(*a, **k))
    ids = tokenizer("naïve café ☕", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.push(i) for i in ids)
    assert not calls
    assert text + detok.flush() == decode(ids)


def test_a_resumed_output_emits_the_text_its_last_worker_held_and_the_whole_equals_the_full_decode(tokenizer):
    text = "Grüße aus Köln: 東京 🙂 and more 日本語"
    ids = tokenizer(text)["input_ids"]
    for cut in range(1, len(ids)):
        first = IncrementalDetokenizer(tokenizer)
        sent, held = [], 0
        for token_id in ids[:cut]:  # the worker that was lost
            piece = first.push(token_id)
            sent.append(piece)
            held = held + 1 if not piece else 0
        resumed = IncrementalDetokenizer(tokenizer)  # the worker that continues from the prompt + ids[:cut]
        resumed.resume(ids[max(0, cut - held - 4):cut - held], ids[cut - held:cut])
        rest = [resumed.push(token_id) for token_id in ids[cut:]] + [resumed.flush()]
        assert "".join(sent + rest) == text, cut
