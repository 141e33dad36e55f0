"""Draft proposers over a request's token array: `ngram` (prompt lookup, as vLLM's) and `suffix` (a suffix match
over the request's text and the coordinator's hints, drafting by the continuations' frequencies, as Arctic's
suffix decoding). Both answer from vectorized scans of the arrays: nothing is kept between steps but the tokens."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from worker.engine.speculative.config import SpeculativeConfig

_EMPTY = np.empty(0, dtype=np.int64)


class TokenHistory:
    """A request's prompt + output as a growing int array (appended to, never rebuilt)."""

    def __init__(self, token_ids: Sequence[int] = ()):
        self.tokens = np.zeros(max(64, 2 * len(token_ids)), dtype=np.int64)
        self.length = 0
        self.extend(token_ids)

    def extend(self, token_ids: Sequence[int]) -> None:
        need = self.length + len(token_ids)
        if need > len(self.tokens):
            grown = np.zeros(max(need, 2 * len(self.tokens)), dtype=np.int64)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        self.tokens[self.length : need] = token_ids
        self.length = need

    @property
    def view(self) -> np.ndarray:
        return self.tokens[: self.length]


def suffix_matches(text: np.ndarray, doc: np.ndarray, end: int, max_n: int) -> tuple[np.ndarray, np.ndarray]:
    """Every position i < `end` of `doc` whose tokens up to i end as `text` ends, and how many tokens match there
    (1 .. max_n): the occurrences of the text's suffix, whose continuations start at i + 1."""
    n = len(text)
    if n == 0 or end <= 0:
        return _EMPTY, _EMPTY
    idx = np.flatnonzero(doc[:end] == text[n - 1])
    lengths = np.ones(len(idx), dtype=np.int64)
    active = np.ones(len(idx), dtype=bool)
    for j in range(1, min(max_n, n)):
        active &= idx >= j
        if not active.any():
            break
        where = np.flatnonzero(active)
        active[where] = doc[idx[where] - j] == text[n - 1 - j]
        lengths += active
    return idx, lengths


class NgramProposer:
    """The longest suffix of the text, of prompt_lookup_min .. prompt_lookup_max tokens, found earlier in it (the
    earliest occurrence on ties, vLLM's rule); the tokens that followed it there are the draft."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, text: np.ndarray, hints: Sequence[np.ndarray], k: int) -> list[int]:
        n = len(text)
        idx, lengths = suffix_matches(text, text, n - 1, self.max_n)
        if not len(idx):
            return []
        best = int(lengths.max())
        if best < self.min_n:
            return []
        start = int(idx[np.argmax(lengths == best)]) + 1
        return text[start : min(start + k, n)].tolist()


class SuffixProposer:
    """The text's longest suffix (up to suffix_max_depth tokens) matched in the text and in each hint; from all its
    occurrences, the draft follows the most frequent continuation token by token, while the estimated probability
    of the whole draft (the product of each step's share) stays above suffix_min_token_prob, and at most
    suffix_max_spec_factor times the match's length."""

    def __init__(self, config: SpeculativeConfig):
        self.max_depth = config.suffix_max_depth
        self.min_prob = config.suffix_min_token_prob
        self.factor = config.suffix_max_spec_factor

    def propose(self, text: np.ndarray, hints: Sequence[np.ndarray], k: int) -> list[int]:
        docs = [(text, len(text) - 1)] + [(hint, len(hint) - 1) for hint in hints]
        found = [(doc, *suffix_matches(text, doc, end, self.max_depth)) for doc, end in docs]
        best = max((int(lengths.max()) for _, _, lengths in found if len(lengths)), default=0)
        if not best:
            return []
        # Continuations of the longest match's occurrences: (doc, their next positions), narrowed as the draft grows.
        alive = [(doc, idx[lengths == best] + 1) for doc, idx, lengths in found if len(lengths)]
        alive = [(doc, starts) for doc, starts in alive if len(starts)]
        limit = min(k, max(1, int(self.factor * best)))
        draft: list[int] = []
        prob = 1.0
        for t in range(limit):
            alive = [(doc, starts[starts + t < len(doc)]) for doc, starts in alive]
            alive = [(doc, starts) for doc, starts in alive if len(starts)]
            if not alive:
                break
            nexts = np.concatenate([doc[starts + t] for doc, starts in alive])
            values, counts = np.unique(nexts, return_counts=True)
            top = int(np.argmax(counts))
            prob *= counts[top] / len(nexts)
            if prob < self.min_prob:
                break
            token = values[top]
            draft.append(int(token))
            alive = [(doc, starts[doc[starts + t] == token]) for doc, starts in alive]
        return draft


def make_proposer(config: SpeculativeConfig) -> NgramProposer | SuffixProposer:
    return NgramProposer(config) if config.method == "ngram" else SuffixProposer(config)
