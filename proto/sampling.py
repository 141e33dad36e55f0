"""The sampling rules both ends hold for a request, and their defaults, defined once (no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingRules:
    """How to pick each token and when to stop: the fields the coordinator's SamplingOptions and a worker's
    SamplingParams share. Each client API applies its own defaults (OpenAI's temperature 1.0) before these."""

    # The wire's: a worker reads a field a pb.SamplingParams leaves out (zero) as its default here, greedy included.
    temperature: float = 0.0
    top_p: float = 1.0
    typical_p: float = 1.0  # locally typical sampling's mass, (0, 1); 1: off
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True  # a proto3 bool cannot tell False from left out: the coordinator always sets it
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)


DEFAULT_SAMPLING = SamplingRules()
