"""Guided decoding on a real worker: request checks, each sequence's matcher, and a step's grammar masks.

Grammars are compiled before a request reaches the engine (`Guidance.check`, on a servicer thread), so
the engine only copies cached grammars into matchers. A step computes the masks of all its constrained
rows together (llguidance's executor, one reused bitmask) and the sampler applies them in one fill.
"""

from __future__ import annotations

from collections.abc import Iterable

import llguidance
import torch

from guidance.compiler import GrammarError, compiler_for
from guidance.token_rules import LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS_ENTRIES
from worker.engine.errors import InvalidRequest
from worker.engine.sequence import SamplingParams


class GrammarMasks:
    """Which tokens each constrained row's grammar forbids, for a whole step at once, in reused buffers."""

    def __init__(self, vocab_size: int, num_threads: int | None = None):
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor(num_threads)
        self._bitmask = torch.empty(0, self._words, dtype=torch.int32)
        self._bytes = torch.empty(0, self._words * 4, dtype=torch.int32)
        self._banned = torch.empty(0, self._words * 32, dtype=torch.bool)
        # Row b: the 8 tokens of a mask byte of value b, True where banned (llguidance sets allowed bits).
        self._byte_table = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) == 0

    @torch.inference_mode()
    def banned(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """[len(matchers), vocab_size] bool, True where that row's grammar forbids the token; a view of a
        reused buffer, valid until the next call."""
        n = len(matchers)
        if self._bitmask.shape[0] < n:
            rows = max(n, 2 * self._bitmask.shape[0], 8)
            self._bitmask = torch.empty(rows, self._words, dtype=torch.int32)
            self._bytes = torch.empty(rows, self._words * 4, dtype=torch.int32)
            self._banned = torch.empty(rows, self._words * 32, dtype=torch.bool)
        bitmask = self._bitmask[:n]
        import llguidance.torch  # loaded already by `load_kernel`, at the request's check

        if n == 1:  # nothing to share out: skip the hand-off to the pool's threads
            llguidance.torch.fill_next_token_bitmask(matchers[0], bitmask)
        else:
            llguidance.torch.fill_next_token_bitmask_par(self._executor, list(zip(matchers, range(n))), bitmask)
        # Little-endian words: bit k of byte j is token 8j + k. One table lookup per byte unpacks it.
        self._bytes[:n].copy_(bitmask.view(torch.uint8))
        torch.index_select(self._byte_table, 0, self._bytes[:n].view(-1), out=self._banned[:n].view(-1, 8))
        return self._banned[:n, : self.vocab_size]

    @staticmethod
    def load_kernel() -> None:
        """Import llguidance's torch kernel: the import compiles it (torch._dynamo, ~1.5 s of CPU, far more on a
        loaded machine), so it is paid by the first guided request's check, not by every worker start, and never
        between a prefill's last KV layer and its first token, where the decode worker's stall timer runs."""
        import llguidance.torch  # noqa: F401

    @staticmethod
    def consume(matchers: list[llguidance.LLMatcher], tokens: list[int]) -> list[bool]:
        """Advance each matcher over its row's chosen token; False where it refused (it is now in error)."""
        # One at a time on the engine thread: a consume costs microseconds, less than a hand-off to the pool.
        return [matcher.consume_token(token) for matcher, token in zip(matchers, tokens)]


class Guidance:
    """A real engine's guided decoding and logit_bias: request checks, matchers, the step masks."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
        self.vocab_size = vocab_size
        self.compiler, self._unavailable = compiler_for(hf_tokenizer, vocab_size, eos_token_ids)
        self.masks = GrammarMasks(vocab_size) if self.compiler is not None else None

    def check(self, sampling: SamplingParams) -> None:
        """Raise InvalidRequest unless logit_bias names vocabulary ids within range and the grammar compiles
        and accepts the replayed tokens. Compiling may take long: call it off the engine and event loop."""
        if len(sampling.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequest(f"logit_bias has {len(sampling.logit_bias)} entries; at most "
                                 f"{MAX_LOGIT_BIAS_ENTRIES} are allowed")
        for token_id, bias in sampling.logit_bias:
            if not 0 <= token_id < self.vocab_size:
                raise InvalidRequest(f"logit_bias names token id {token_id}, outside the model's vocabulary "
                                     f"[0, {self.vocab_size})")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:  # NaN fails too
                raise InvalidRequest(f"logit_bias of token id {token_id} is {bias}; it must be in [-100, 100]")
        self.matcher(sampling)

    def matcher(self, sampling: SamplingParams) -> llguidance.LLMatcher | None:
        """A fresh matcher for the request's grammar, advanced over `grammar_generated`; None without one."""
        if sampling.grammar is None:
            return None
        if self.compiler is None:
            raise InvalidRequest(self._unavailable)
        self.masks.load_kernel()
        try:
            return self.compiler.matcher(sampling.grammar, sampling.grammar_generated)
        except GrammarError as exc:
            raise InvalidRequest(f"guided decoding: {exc}") from None
