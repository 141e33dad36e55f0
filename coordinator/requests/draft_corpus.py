"""The coordinator's draft corpus for speculative decoding: finished outputs kept per tenant, model and adapter, and
for a new request the earlier outputs whose prompts ended as its prompt ends, sent once with its decode request
as draft hints (the decode worker drafts from them beside the request's own text; its verify step keeps the
output exact, so a hint only ever costs or saves time).

  - An entry is one output's first `max_hint_tokens` tokens (identical outputs are one entry), indexed by hashes
    of its prompt's last N tokens for each N of `tail_lengths` (the whole prompt when shorter, if it has at least
    `min_tail_tokens`); a lookup tries the longest tail first, the most recent entries first within one.
  - An entry is kept as the pb.DraftHint the decode request carries, encoded once: a request's frame then parses
    bytes instead of encoding tokens (4 hints of 256 tokens: about 30 µs of the coordinator's CPU, not 160).
  - One tenant's outputs never draft for another's request: each (tenant, model, adapter) has its own entries.
  - Memory is bounded in tokens: an entry counts its tokens plus ENTRY_TOKENS; past `max_corpus_tokens` in one
    corpus, or `max_total_tokens` in all, the least recently used entries (recorded or hinted) go, whole.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from coordinator.requests.request import GenerationRequest
from proto import worker_pb2 as pb

ENTRY_TOKENS = 32  # what an entry's own bookkeeping (its dict slots, its index keys) is charged, in tokens
TAIL_TOKENS = 2  # and each prompt tail it is indexed under: an output repeated for many prompts grows by these

CorpusKey = tuple[str | None, str, str | None]  # tenant (None: no tenancy), model, adapter (None: the base model)


class SpeculativeConfig(BaseModel):
    """`speculative_config` in ms_coordinator.json: the draft corpus (docs/operating/speculative-decoding.md)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Keep finished outputs per tenant, model and adapter, and send a new "
                          "request's decode worker the earlier outputs whose prompts ended as its prompt ends, as "
                          "draft hints. pdserve workers only: vLLM instances are never sent hints. Off: no corpus "
                          "(the x-pdserve-speculative header works either way).")
    # The upper bounds are what a pdserve worker takes (worker/service/servicers.py refuses a request with more).
    max_hints: int = Field(4, ge=1, le=16, description="Hints sent with one request, at most.")
    max_hint_tokens: int = Field(512, ge=1, le=8192, description="Tokens of one hint, at most: an output is kept up "
                                 "to this many tokens.")
    max_corpus_tokens: int = Field(200_000, ge=1, le=1_000_000_000, description="Tokens kept for one tenant, model "
                                   "and adapter (an entry counts its tokens plus 32, and 2 per prompt tail it is "
                                   "indexed under); past it, its least recently used entries go.")
    max_total_tokens: int = Field(2_000_000, ge=1, le=10_000_000_000, description="Tokens kept in all corpora "
                                  "together (2 to 5 bytes each); past it, the least recently used entries go.")
    tail_lengths: list[int] = Field([64, 32, 16, 8], min_length=1, max_length=16, description="The prompt tail "
                                    "lengths an output is indexed by and a prompt looked up by, each in [1, 4096]; "
                                    "the longest match wins.")
    min_tail_tokens: int = Field(4, ge=1, le=4096, description="A prompt shorter than a tail length matches on the "
                                 "whole of it, if it has at least this many tokens; a shorter prompt neither gives "
                                 "nor gets hints.")

    @field_validator("tail_lengths")
    @classmethod
    def _lengths(cls, lengths: list[int]) -> list[int]:
        wrong = [n for n in lengths if not 1 <= n <= 4096]
        if wrong:
            raise ValueError(f"tail lengths must be in [1, 4096], got {wrong}")
        return sorted(set(lengths), reverse=True)

    @model_validator(mode="after")
    def _bounds_nest(self) -> SpeculativeConfig:
        if self.min_tail_tokens > self.tail_lengths[-1]:
            raise ValueError(f"min_tail_tokens={self.min_tail_tokens} exceeds the shortest of "
                             f"tail_lengths={self.tail_lengths}: that tail could never match")
        if self.max_hint_tokens + ENTRY_TOKENS > self.max_corpus_tokens:
            raise ValueError(f"max_corpus_tokens={self.max_corpus_tokens} cannot hold one entry of "
                             f"max_hint_tokens={self.max_hint_tokens} (plus {ENTRY_TOKENS})")
        if self.max_corpus_tokens > self.max_total_tokens:
            raise ValueError(f"max_corpus_tokens={self.max_corpus_tokens} exceeds "
                             f"max_total_tokens={self.max_total_tokens}")
        return self


class _Entry:
    """One kept output (an encoded pb.DraftHint), the corpus it is in, the prompt tails it is indexed under."""

    __slots__ = ("hint", "digest", "key", "tails", "cost")

    def __init__(self, hint: bytes, digest: int, key: CorpusKey, num_tokens: int):
        self.hint = hint
        self.digest = digest
        self.key = key
        self.tails: set[tuple[int, int]] = set()
        self.cost = num_tokens + ENTRY_TOKENS


class _Corpus:
    """One (tenant, model, adapter)'s entries, least recently used first, and its index of prompt tails."""

    __slots__ = ("entries", "index", "by_digest", "tokens")

    def __init__(self):
        self.entries: OrderedDict[_Entry, None] = OrderedDict()
        self.index: dict[tuple[int, int], list[_Entry]] = {}  # (tail length, hash) -> the latest max_hints entries
        self.by_digest: dict[int, _Entry] = {}
        self.tokens = 0


class DraftCorpus:
    """Every corpus of this coordinator (replicas on etcd keep their own), bounded in tokens."""

    def __init__(self, config: SpeculativeConfig, model: str):
        self.config = config
        self.model = model
        self._corpora: dict[CorpusKey, _Corpus] = {}
        self._lru: OrderedDict[_Entry, None] = OrderedDict()  # every entry, least recently used first
        self.num_tokens = 0  # as max_total_tokens counts them

    @property
    def num_entries(self) -> int:
        return len(self._lru)

    def key_of(self, request: GenerationRequest) -> CorpusKey:
        ticket, lora = request.ticket, request.lora
        return (ticket.tenant.name if ticket is not None else None, self.model,
                lora.name if lora is not None else None)

    def hints_for(self, request: GenerationRequest) -> tuple[bytes, ...]:
        """The hints for `request`'s prompt from its tenant's, model's and adapter's corpus."""
        return self.hints(self.key_of(request), request.prompt_token_ids)

    def learn(self, request: GenerationRequest, output: Sequence[int]) -> None:
        """Keep a finished generation's `output` under `request`'s tenant, model, adapter and prompt tail."""
        self.record(self.key_of(request), request.prompt_token_ids, output)

    def hints(self, key: CorpusKey, prompt: Sequence[int]) -> tuple[bytes, ...]:
        """Up to max_hints outputs whose prompts ended as `prompt` ends, each an encoded pb.DraftHint: longest tail
        first, then most recent."""
        corpus = self._corpora.get(key)
        if corpus is None:
            return ()
        limit = self.config.max_hints
        found: list[_Entry] = []
        for tail in self._tails(prompt):
            for entry in reversed(corpus.index.get(tail, ())):
                if entry not in found:
                    found.append(entry)
            if len(found) >= limit:
                del found[limit:]
                break
        for entry in found:
            self._touch(corpus, entry)
        return tuple(entry.hint for entry in found)

    def record(self, key: CorpusKey, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Keep `output` (its first max_hint_tokens) as a hint for prompts that end as `prompt` does."""
        tails = self._tails(prompt)
        if not tails or not output:
            return
        tokens = output[:self.config.max_hint_tokens]
        hint = pb.DraftHint(token_ids=tokens).SerializeToString()
        digest = hash(hint)
        corpus = self._corpora.get(key)
        if corpus is None:
            corpus = self._corpora[key] = _Corpus()
        entry = corpus.by_digest.get(digest)
        if entry is not None and entry.hint == hint:
            self._touch(corpus, entry)
        else:
            entry = _Entry(hint, digest, key, len(tokens))
            corpus.entries[entry] = None
            self._lru[entry] = None
            corpus.by_digest[digest] = entry
            self._charge(corpus, entry.cost)
        limit = self.config.max_hints
        for tail in tails:
            bucket = corpus.index.setdefault(tail, [])
            if entry in bucket:
                bucket.remove(entry)
            bucket.append(entry)
            if len(bucket) > limit:
                del bucket[0]
            if tail not in entry.tails:
                entry.tails.add(tail)
                entry.cost += TAIL_TOKENS
                self._charge(corpus, TAIL_TOKENS)
        while corpus.tokens > self.config.max_corpus_tokens:
            self._drop(next(iter(corpus.entries)))
        while self.num_tokens > self.config.max_total_tokens:
            self._drop(next(iter(self._lru)))

    def _tails(self, prompt: Sequence[int]) -> list[tuple[int, int]]:
        """(length, hash) of each of the prompt's tails that may match, longest first."""
        size = len(prompt)
        if size < self.config.min_tail_tokens:
            return []
        lengths = self.config.tail_lengths  # longest first
        if size < lengths[0]:
            lengths = [size, *(n for n in lengths if n < size)]
        return [(n, hash(tuple(prompt[size - n:]))) for n in lengths]

    def _touch(self, corpus: _Corpus, entry: _Entry) -> None:
        corpus.entries.move_to_end(entry)
        self._lru.move_to_end(entry)

    def _charge(self, corpus: _Corpus, tokens: int) -> None:
        corpus.tokens += tokens
        self.num_tokens += tokens

    def _drop(self, entry: _Entry) -> None:
        corpus = self._corpora[entry.key]
        del corpus.entries[entry]
        del self._lru[entry]
        if corpus.by_digest.get(entry.digest) is entry:
            del corpus.by_digest[entry.digest]
        for tail in entry.tails:
            bucket = corpus.index.get(tail)
            if bucket is not None and entry in bucket:
                bucket.remove(entry)
                if not bucket:
                    del corpus.index[tail]
        corpus.tokens -= entry.cost
        self.num_tokens -= entry.cost
        if not corpus.entries:
            del self._corpora[entry.key]
