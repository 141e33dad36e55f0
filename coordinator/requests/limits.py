"""Model limits the coordinator enforces before any worker sees a request."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.errors import ApiError

MAX_INPUT_BYTES = 4 * 1024 * 1024
# Prompt logprobs travel in the KV stream's trailer (a 1 MiB message at most): about 11 bytes a (token or
# alternative) entry, so a prompt's tokens x (alternatives + 1) stay under this many.
MAX_PROMPT_LOGPROB_ENTRIES = 65_536


@dataclass(frozen=True)
class ModelLimits:
    """maxSeqLen, maxInputTokenLen, maxIterTimes and the checkpoint's position limit."""

    max_seq_len: int
    max_input_token_len: int
    max_iter_times: int
    max_position_embeddings: int

    @property
    def max_prompt_tokens(self) -> int:
        return min(self.max_input_token_len, self.max_seq_len - 1, self.max_position_embeddings)

    def check_text(self, text: str, param: str) -> None:
        if not text:
            raise ApiError(400, f"{param} must not be empty", param=param)
        if len(text.encode("utf-8")) > MAX_INPUT_BYTES:
            raise ApiError(413, f"{param} is larger than {MAX_INPUT_BYTES} bytes (4 MB)", param=param)

    def check_prompt(self, num_tokens: int, param: str) -> None:
        if num_tokens > self.max_prompt_tokens:
            raise ApiError(
                400,
                f"{param} has {num_tokens} tokens; the limit is min(maxInputTokenLen={self.max_input_token_len}, "
                f"maxSeqLen-1={self.max_seq_len - 1}, max_position_embeddings={self.max_position_embeddings}) "
                f"= {self.max_prompt_tokens}",
                param=param,
            )

    def check_prompt_logprobs(self, num_tokens: int, alternatives: int | None, param: str) -> None:
        """A 400 when a prompt's logprobs would not fit in one message: its tokens x (alternatives + 1) entries."""
        if alternatives is not None and num_tokens * (alternatives + 1) > MAX_PROMPT_LOGPROB_ENTRIES:
            raise ApiError(400, f"{param}: prompt logprobs for {num_tokens} prompt tokens with {alternatives} "
                                f"alternatives each are more than {MAX_PROMPT_LOGPROB_ENTRIES} entries; ask for fewer "
                                "alternatives or send a shorter prompt", param=param)

    def generation_cap(self, requested: int | None, prompt_tokens: int, param: str = "max_tokens") -> int:
        """Tokens to generate, the prefill worker's first one included.

        The decode worker runs at most maxIterTimes steps after the first token, so a request
        capped by maxIterTimes (or asking for nothing or for more) gets maxIterTimes + 1 tokens.
        A request that names more tokens than fit after its prompt in maxSeqLen can never be
        served and is refused; one that names none stops at maxSeqLen.
        """
        room = self.max_seq_len - prompt_tokens
        if requested is not None and requested > room:
            raise ApiError(
                400,
                f"{param}={requested} plus the prompt's {prompt_tokens} tokens exceeds maxSeqLen={self.max_seq_len}; "
                f"at most {room} tokens can be generated for this prompt",
                param=param,
            )
        if requested is None or requested > self.max_iter_times:
            return min(self.max_iter_times + 1, room)
        return requested
