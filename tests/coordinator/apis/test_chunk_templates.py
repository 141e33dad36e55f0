"""Pre-encoded token chunks (ChunkTemplate) are byte for byte what the dict path encodes."""

from __future__ import annotations

import pytest

from coordinator.apis.openai_chat import ChatFormatter
from coordinator.apis.openai_completions import CompletionFormatter
from coordinator.requests.request import TokenDelta
from coordinator.requests.serving import Transcript

TEXTS = ["Hello", ", wor", "ld \"quoted\" \\ back", "\n\t", "ünï😀", "", "\x00\x1f ctrl", "<think>why", " so",
         "</think>ok", " done"]


def deltas() -> list[TokenDelta]:
    return [TokenDelta(token_id=i, text=t, index=i, time_ms=1.0) for i, t in enumerate(TEXTS)]


def both_paths(make):
    """Feed the same deltas to two formatters: one through token_bytes, one through token_frames."""
    fast, slow = make(), make()
    fast_transcript, slow_transcript = Transcript(), Transcript()
    for delta in deltas():
        fast_transcript.add(delta)
        slow_transcript.add(delta)
        data = fast.token_bytes(delta, fast_transcript)
        assert data is not None, "a plain token took the slow path"
        assert data == b"".join(map(slow.encode, slow.token_frames(delta, slow_transcript))), delta


@pytest.mark.parametrize("parse_tools", [False, True])
def test_chat_chunks_from_the_template_equal_the_encoded_dicts(parse_tools):
    def make():
        formatter = ChatFormatter("chatcmpl-1", 1700000000, "pdserve-tiny", False, False, [1, 2])
        formatter.parse_tools = parse_tools
        return formatter

    both_paths(make)


def test_completion_chunks_from_the_template_equal_the_encoded_dicts():
    both_paths(lambda: CompletionFormatter("cmpl-1", 1700000000, "pdserve-tiny", False, False, [1, 2]))


def test_chunks_with_more_than_text_varying_take_the_dict_path():
    full_text = CompletionFormatter("cmpl-1", 0, "m", True, False, [1])
    token_ids = ChatFormatter("chatcmpl-1", 0, "m", False, True, [1])
    with_logprobs = TokenDelta(token_id=3, text="x", index=0, time_ms=1.0, logprob=-0.5)
    plain = TokenDelta(token_id=3, text="x", index=0, time_ms=1.0)
    assert full_text.token_bytes(plain, Transcript("x")) is None
    assert token_ids.token_bytes(plain, Transcript("x")) is None
    assert CompletionFormatter("cmpl-1", 0, "m", False, False, [1]).token_bytes(with_logprobs, Transcript("x")) is None
