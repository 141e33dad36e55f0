"""A decode worker's speculative-decoding settings (`pdserve worker --speculative-method ...`)."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "suffix")
# ngram drafts whatever followed its match, so a long draft is often a wasted one; suffix sizes each draft by the
# match's length and the continuation's frequency, so its cap can be high (vLLM's suffix default is 24).
DEFAULT_TOKENS = {"ngram": 5, "suffix": 16}


@dataclass(frozen=True)
class SpeculativeConfig:
    """How a decode worker drafts: the method, how many tokens at most, and when it stops drafting."""

    method: str = "ngram"
    # Draft tokens per row and step, at most; None: the method's default (DEFAULT_TOKENS).
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int = 2  # ngram: the shortest suffix of the text that may match earlier
    prompt_lookup_max: int = 5  # ngram: the longest one looked for
    disable_batch_size: int = 32  # no drafting in a step with more rows than this (compute-bound, drafts cost)
    cooldown_steps: int = 4  # a row whose drafts were all rejected drafts again after this many steps (doubling)
    max_cooldown_steps: int = 64
    suffix_max_depth: int = 24  # suffix: the longest suffix matched
    suffix_min_token_prob: float = 0.1  # suffix: stop a draft where its estimated probability falls below this
    suffix_max_spec_factor: float = 1.0  # suffix: a draft is at most this times the match's length

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"--speculative-method {self.method!r}: must be one of {', '.join(METHODS)}")
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", DEFAULT_TOKENS[self.method])
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(f"--num-speculative-tokens {self.num_speculative_tokens}: must be in [1, 32]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise ValueError(f"--prompt-lookup-min {self.prompt_lookup_min} and --prompt-lookup-max "
                             f"{self.prompt_lookup_max}: need 1 <= min <= max <= 64")
        if self.disable_batch_size < 1:
            raise ValueError(f"--speculative-disable-batch-size {self.disable_batch_size}: must be >= 1")
        if not 0 <= self.cooldown_steps <= self.max_cooldown_steps:
            raise ValueError(f"cooldown_steps {self.cooldown_steps}: must be in [0, {self.max_cooldown_steps}]")
        if not 1 <= self.suffix_max_depth <= 256:
            raise ValueError(f"suffix_max_depth {self.suffix_max_depth}: must be in [1, 256]")
        if not 0.0 <= self.suffix_min_token_prob < 1.0:
            raise ValueError(f"suffix_min_token_prob {self.suffix_min_token_prob}: must be in [0, 1)")
        if self.suffix_max_spec_factor <= 0:
            raise ValueError(f"suffix_max_spec_factor {self.suffix_max_spec_factor}: must be > 0")
