"""PretokenCache: a prompt's ids from a cache of each pre-token's ids, equal to what the Rust tokenizer gives.

A byte-level BPE tokenizer (GPT-2's, SmolLM's, Llama-3's, Qwen's) splits text into pre-tokens with one regex and
runs BPE on each pre-token alone, so a prompt's ids are the concatenation of its pre-tokens' ids (between the
post-processor's specials). Rust spends most of a prompt's time in its regex engine and in building the Encoding
(offsets, word ids); here the split is Python's `regex` and the ids come from a dict, about five times cheaper.
It serves only what it is sure of, and gives None for the caller to ask Rust otherwise:
- a tokenizer of a known shape (no normalizer, a ByteLevel pre-tokenizer with GPT-2's regex, or a Split regex then
  ByteLevel without one; no truncation or padding);
- ASCII text (regex engines may differ on Unicode's classes, never on ASCII's);
- added tokens (a chat template's markers) split out first, as Rust does, only when none strips the text beside it
  or must stand as a word;
- every new pre-token is checked to be one pre-token for Rust's own pre-tokenizer before its ids are kept, and the
  pre-tokens to cover the text.
"""

from __future__ import annotations

import json
from itertools import chain

import regex

# tokenizers' ByteLevel pre-tokenizer's regex (use_regex: true)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
MAX_ENTRIES = 200_000  # pre-tokens kept; the cache starts over past it


def _split_pattern(pre_tokenizer: dict | None) -> str | None:
    """The regex a known pre-tokenizer splits by, or None."""
    if not pre_tokenizer:
        return None
    kind = pre_tokenizer.get("type")
    if kind == "ByteLevel":
        ok = pre_tokenizer.get("use_regex", True) and not pre_tokenizer.get("add_prefix_space")
        return GPT2_PATTERN if ok else None
    if kind == "Sequence":
        steps = pre_tokenizer.get("pretokenizers") or []
        if len(steps) != 2:
            return None
        split, byte_level = steps
        if (split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert")
                or "Regex" not in (split.get("pattern") or {})):
            return None
        if (byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex", True)
                or byte_level.get("add_prefix_space")):
            return None
        return split["pattern"]["Regex"]
    return None


class PretokenCache:
    """`encode(text)`: the ids Rust's `encode(text, add_special_tokens=True)` gives, or None when not sure."""

    def __init__(self, backend):
        self._backend = backend  # tokenizers.Tokenizer
        self._ids: dict[str, list[int]] = {}
        config = json.loads(backend.to_str())
        pattern = _split_pattern(config.get("pre_tokenizer"))
        usable = (pattern is not None and config.get("normalizer") is None and config.get("truncation") is None
                  and config.get("padding") is None)
        added = config.get("added_tokens") or ()
        if any(token.get("lstrip") or token.get("rstrip") or token.get("single_word") for token in added):
            usable = False
        if len({bool(token.get("normalized")) for token in added}) > 1:
            usable = False  # Rust matches the two kinds in two passes: one longest-first pass may differ
        self._added_ids = {token["content"]: token["id"] for token in added}
        # Longest first, as Rust matches them; a capturing group keeps them in the split's output.
        contents = sorted(self._added_ids, key=len, reverse=True)
        self._split_added = regex.compile("(" + "|".join(map(regex.escape, contents)) + ")").split if contents else None
        self._split = regex.compile(pattern).findall if usable else None
        # The post-processor's specials around a single sequence, found from a probe's ids with and without them.
        self._before: list[int] = []
        self._after: list[int] = []
        if self._split is not None:
            bare = backend.encode("a", add_special_tokens=False).ids
            full = backend.encode("a", add_special_tokens=True).ids
            at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
            if at is None:
                self._split = None
            else:
                self._before, self._after = full[:at], full[at + len(bare):]

    @property
    def usable(self) -> bool:
        return self._split is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int] | None:
        # encode_special_tokens (transformers' split_special_tokens, settable per call): markers are text then.
        if self._split is None or not text.isascii() or self._backend.encode_special_tokens:
            return None
        ids = list(self._before) if add_special_tokens else []
        if self._split_added is None:
            if not self._extend(ids, text):
                return None
        else:
            # Text, added token, text, ...: the added tokens at the odd places.
            for i, part in enumerate(self._split_added(text)):
                if i % 2:
                    ids.append(self._added_ids[part])
                elif part and not self._extend(ids, part):
                    return None
        if add_special_tokens:
            ids += self._after
        return ids

    def _extend(self, ids: list[int], text: str) -> bool:
        pieces = self._split(text)
        if sum(map(len, pieces)) != len(text):
            return False  # the regex left characters out: Rust keeps them as pre-tokens of their own
        known = self._ids
        start = len(ids)
        try:  # every pre-token known (the common case): the lookups and the joining in C
            ids.extend(chain.from_iterable(map(known.__getitem__, pieces)))
            return True
        except KeyError:
            del ids[start:]
        if len(known) + len(pieces) > MAX_ENTRIES:
            # A new dict rather than clear(): a thread joining from the old one (a long prompt's, off the event
            # loop) keeps its entries.
            known = self._ids = {}
        for piece in pieces:
            if piece not in known:
                piece_ids = self._ids_of(piece)
                if piece_ids is None:
                    return False
                known[piece] = piece_ids
        ids.extend(chain.from_iterable(map(known.__getitem__, pieces)))
        return True

    def _ids_of(self, piece: str) -> list[int] | None:
        if len(self._backend.pre_tokenizer.pre_tokenize_str(piece)) != 1:
            return None  # Rust would split it further: not ours to guess
        return self._backend.encode(piece, add_special_tokens=False).ids
