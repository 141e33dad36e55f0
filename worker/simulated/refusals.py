"""What a simulated worker cannot honour: with no tokenizer and synthetic tokens, no grammar and no logit_bias.
Logprobs, the prompt's included, it leaves out (null in the answers), as it has no model to give them."""

from __future__ import annotations

from worker.engine.errors import InvalidRequest
from worker.engine.sequence import SamplingParams


class RefusesTokenConstraints:
    """`check_sampling` of a simulated engine: requests that constrain tokens are refused (INVALID_ARGUMENT)."""

    def check_sampling(self, sampling: SamplingParams) -> None:
        if sampling.grammar is not None:
            raise InvalidRequest("guided decoding (guided) is not available on a simulated worker: it has no tokenizer")
        if sampling.logit_bias:
            raise InvalidRequest("logit_bias is not available on a simulated worker: it has no tokenizer")

