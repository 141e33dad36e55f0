"""Incremental detokenizing and stop-string hold-back."""

from __future__ import annotations

from worker.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher


def test_incremental_text_equals_full_decode_with_multibyte_characters(hf_model):
    _, tokenizer = hf_model
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
