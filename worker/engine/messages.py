"""What an engine's worker (thread or task) tells the event loop, and what the loop tells a decode thread.

Plain dataclasses, dispatched with `match`; no torch here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import ClassVar

from kv_transfer.wire import LayerBytes
from worker.engine.block_pool import BlockTable
from worker.engine.sequence import Sequence, TokenLogprobs


# Prefill engine -> the job's KV stream, in order: KvLayerReady per layer, then PrefillDone or PrefillFailed.
@dataclass(frozen=True)
class KvLayerReady:
    """One layer of a prompt's KV cache, ready to send (tensors on the real backend, bytes on the simulated one)."""

    layer: LayerBytes


@dataclass(frozen=True)
class PrefillDone:
    """The prefill ran: its first token, the time from submission to that token, and of that the forward's
    (the rest waited in the prefill queue); `done_at` is when, on time.perf_counter."""

    first_token_id: int
    prefill_ms: float
    logprobs: TokenLogprobs | None = None
    forward_ms: float = 0.0
    done_at: float = 0.0
    cached_tokens: int = 0  # prompt positions found in the prefix cache (not computed)
    prompt_logprobs: list | None = None  # TokenLogprobs (with rank) of prompt tokens 1 .. n-1, when asked


@dataclass(frozen=True)
class PrefillFailed:
    """The forward failed; the stream ends without a trailer, so the decode worker refuses it."""

    message: str
    invalid: bool = False  # the request's own fault (its grammar failed): any worker would fail it the same way


PrefillEvent = KvLayerReady | PrefillDone | PrefillFailed


class SequenceWork:
    """A decode worker's PromptWork over a sequence's own blocks: its images and table are the sequence's."""

    seq: Sequence

    @property
    def media(self) -> tuple:
        return self.seq.media

    @property
    def prepared_media(self):
        return self.seq.prepared_media

    @property
    def table(self) -> BlockTable:
        return self.seq.table

    @property
    def lora(self):
        return self.seq.lora

    prompt_logprobs: ClassVar[None] = None  # only a prefill worker reports prompt logprobs


@dataclass(eq=False)
class LocalPrefill(SequenceWork):
    """A prompt the decode worker prefills itself (conditional disaggregation); a PromptWork over the sequence's
    own blocks, whose last chunk samples the first token."""

    seq: Sequence
    # Its first-token time counts from here, admission wait included, as on a prefill worker.
    submitted_at: float
    num_computed: int = 0
    extra_positions: int = 1  # the first token's, held from the start: it joins the batch without waiting
    started: bool = False
    cached_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.seq.prompt_token_ids

    @property
    def cache_token_ids(self) -> list[int]:
        return self.seq.prompt_cache_ids


@dataclass(eq=False)
class Recompute(SequenceWork):
    """A preempted sequence's KV computed again (prompt and every output token but the last, which the next decode
    step feeds), after which it rejoins the batch."""

    seq: Sequence
    token_ids: list[int] = field(init=False)
    cache_token_ids: list[int] = field(init=False)
    num_computed: int = 0
    extra_positions: int = 1  # its last token's, held from the start: it rejoins the batch without waiting
    started: bool = False
    cached_tokens: int = 0

    def __post_init__(self):
        self.token_ids = self.seq.token_ids[:-1]
        self.cache_token_ids = self.seq.cache_token_ids[:-1]


# Event loop -> real decode engine thread (its inbox).
@dataclass(frozen=True)
class AddSequence:
    """A sequence whose KV cache arrived (its `pending_kv`) joins the decode batch."""

    seq: Sequence


@dataclass(frozen=True)
class QueueLocalPrefill:
    """A prompt this decode worker prefills itself."""

    job: LocalPrefill


@dataclass(frozen=True)
class CancelSequence:
    """The request's stream ended: leave the batch now."""

    request_id: str


@dataclass(frozen=True)
class Stop:
    """The engine shuts down."""


class BlocksAsked:
    """A KV receiver's request for pool blocks to receive a stream of `num_positions` positions into, answered by the
    engine thread; the receiver waits only so long, and blocks answered after it gave up go back."""

    def __init__(self, num_positions: int):
        self.num_positions = num_positions
        self._answered = threading.Event()
        self._lock = threading.Lock()
        self._landing = None
        self.gave_up = False  # the receiver stopped waiting before the engine answered

    def answer(self, landing) -> bool:
        """On the engine thread: hand over a KvLanding (None: no room); False if the receiver gave up waiting (the
        landing is then the engine's to give back)."""
        with self._lock:
            if self.gave_up:
                return False
            self._landing = landing
            self._answered.set()
            return True

    def wait(self, timeout_s: float):
        """On the receiver's thread: the KvLanding, or None if the pool had no room or no answer came within
        `timeout_s` (then `gave_up`)."""
        if not self._answered.wait(timeout_s):
            with self._lock:
                if not self._answered.is_set():
                    self.gave_up = True
                    return None
        return self._landing


@dataclass(frozen=True)
class TakeBlocks:
    """A KV stream's header arrived: take pool blocks to receive it straight into (or say there is no room)."""

    ask: BlocksAsked


@dataclass(frozen=True)
class ReturnBlocks:
    """Blocks a transfer took and never handed to a sequence (it failed, or its request is gone): back to the pool."""

    block_ids: list[int]


DecodeCommand = AddSequence | QueueLocalPrefill | CancelSequence | TakeBlocks | ReturnBlocks | Stop
