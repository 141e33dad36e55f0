"""llguidance over one tokenizer: grammars checked and compiled once per distinct text, fresh matchers by copy.

The coordinator uses it to refuse a grammar that does not compile before any worker is used; the
workers use it to build each sequence's matcher. Compiling is the expensive part (up to a second for a
huge grammar, with the GIL released); a compiled matcher in its start state is kept per grammar text
in a bounded LRU, and every request gets a `deep_copy()` of it (microseconds).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable

import llguidance
import llguidance.hf

logger = logging.getLogger(__name__)

# Grammar text beyond this is refused before llguidance sees it: a request body may be megabytes.
MAX_GRAMMAR_CHARS = 256 * 1024
# Bounds on what one grammar may cost to compile and to step (llguidance's own defaults are larger).
PARSER_LIMITS = llguidance.LLParserLimits(max_grammar_size=200_000, max_lexer_states=100_000,
                                          initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000)


class GrammarError(ValueError):
    """A grammar that does not compile, or is too large; the message says why."""


class GrammarCompiler:
    """Checks and compiles llguidance grammars for one tokenizer; thread-safe, compiled grammars cached."""

    def __init__(self, hf_tokenizer, vocab_size: int | None = None, eos_token_ids: Iterable[int] = (),
                 cache_size: int = 256):
        eos = sorted(eos_token_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos or None)
        self.vocab_size = self.tokenizer.vocab_size
        # A compiled grammar, or the message of one that does not compile (never the exception itself: a
        # re-raised exception keeps growing its traceback, and with it the frames of every request).
        self._cache: OrderedDict[str, llguidance.LLMatcher | str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def _compiled(self, grammar: str) -> llguidance.LLMatcher:
        if len(grammar) > MAX_GRAMMAR_CHARS:  # before the cache, so it never keeps oversized text
            raise GrammarError(f"the grammar has {len(grammar)} characters; at most {MAX_GRAMMAR_CHARS} are allowed")
        with self._lock:
            hit = self._cache.get(grammar)
            if hit is not None:
                self._cache.move_to_end(grammar)
        if hit is None:
            hit = self._compile(grammar)  # outside the lock: compiling may take long
            with self._lock:
                self._cache[grammar] = hit
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, str):
            raise GrammarError(hit)
        return hit

    def _compile(self, grammar: str) -> llguidance.LLMatcher | str:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=PARSER_LIMITS)
        return matcher_error(matcher) if matcher.is_error() else matcher

    def check(self, grammar: str) -> None:
        """Raise GrammarError when `grammar` does not compile for this tokenizer (the result is cached)."""
        self._compiled(grammar)

    def matcher(self, grammar: str, generated: Iterable[int] = ()) -> llguidance.LLMatcher:
        """A fresh matcher for `grammar`, advanced over `generated` (tokens already produced under it)."""
        matcher = self._compiled(grammar).deep_copy()
        generated = list(generated)
        if generated and not matcher.consume_tokens(generated):
            raise GrammarError(f"the tokens generated so far do not follow the grammar: {matcher_error(matcher)}")
        return matcher


def compiler_for(hf_tokenizer, vocab_size: int | None = None, eos_token_ids: Iterable[int] = (),
                 cache_size: int = 256) -> tuple[GrammarCompiler | None, str]:
    """A GrammarCompiler for the tokenizer, or None and why llguidance cannot use it (say, a slow tokenizer):
    the caller keeps serving unguided requests and refuses guided ones with that reason."""
    try:
        return GrammarCompiler(hf_tokenizer, vocab_size, eos_token_ids, cache_size), ""
    except Exception as exc:  # llguidance's own errors have no common type
        reason = f"guided decoding is not available: llguidance cannot use this tokenizer ({exc})"
        logger.warning("%s", reason)
        return None, reason


def grammar_failure(matcher: llguidance.LLMatcher) -> str:
    """Why a request's guided decoding ended mid-generation (its grammar's own limits, not the worker's)."""
    return f"guided decoding failed on the worker: {matcher_error(matcher)}"


def matcher_error(matcher: llguidance.LLMatcher) -> str:
    """A matcher's error as one API-ready line, without the parser state dump llguidance appends."""
    return one_line(matcher.get_error().split("<state>", 1)[0])


def one_line(message: str, limit: int = 400) -> str:
    """llguidance's multi-line error (the fault, then a source excerpt) as one API-ready line."""
    text = " ".join(message.split()) or "the grammar does not compile"
    return text if len(text) <= limit else text[: limit - 3] + "..."
