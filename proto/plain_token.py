"""The common token (mid-stream: no finish reason, no logprobs, no stop string) as a slotted object read like a
pb.TokenEvent, made and read at a fraction of a protobuf message's cost, once per token (no torch)."""

from __future__ import annotations


class PlainTokenEvent:
    """What a pb.TokenEvent holds for the common token, as class defaults; a subclass carries the rest in slots
    (a vLLM chunk's token, a token channel's record)."""

    __slots__ = ()
    finish_reason = 0
    batch_size = 1
    queue_wait_ms = 0.0
    logprob = 0.0
    top_logprobs = ()
    prompt_logprobs = ()
    matched_stop = ""
