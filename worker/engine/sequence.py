"""One request's state inside a worker, and the parameters that shape its tokens (no torch)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from proto.sampling import SamplingRules
from worker.engine.block_pool import BlockTable
from kv_events.block_hash import lora_cache_tokens
from worker.engine.media import MediaSpan, cache_token_ids


class StopCause(enum.Enum):
    """Why a sequence stopped generating (the coordinator's FinishReason, on the wire as pb.FinishReason)."""

    EOS = "eos"
    STOP_STRING = "stop_string"
    STOP_TOKEN = "stop_token"
    LENGTH = "length"


class DecodeState(enum.Enum):
    """Where a decode request is in its life cycle; the same for every backend (as SGLang's KVPoll).

    WAITING_FOR_BUDGET -> WAITING_FOR_KV -> DECODING -> FINISHED, or
    WAITING_FOR_BUDGET -> WAITING_FOR_KV -> PREFILLING_LOCALLY -> DECODING -> FINISHED;
    CANCELLED (the stream ended first) or FAILED (its KV or a forward failed) from any state.
    """

    WAITING_FOR_BUDGET = "waiting_for_budget"  # in the KV admission line
    WAITING_FOR_KV = "waiting_for_kv"  # holds budget; its cache is on its way from a prefill worker
    PREFILLING_LOCALLY = "prefilling_locally"  # holds budget; queued for (or in) a prefill on this worker
    DECODING = "decoding"  # its cache is here: in the decode batch, or waiting for a seat in it
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def is_final(self) -> bool:
        return self in (DecodeState.FINISHED, DecodeState.CANCELLED, DecodeState.FAILED)


@dataclass(frozen=True)
class SamplingParams(SamplingRules):
    """How to pick each token and when to stop (the shared rules and defaults, and the worker's own fields); ranges
    are validated by the coordinator."""

    max_tokens: int = 16
    return_logprobs: bool = False
    top_logprobs: int = 0
    grammar: str | None = None  # llguidance grammar text every token must follow
    grammar_generated: tuple[int, ...] = ()  # tokens generated under it by earlier attempts (the prompt's tail)
    prompt_logprobs: int | None = None  # report each prompt token's logprob with this many alternatives; None: no

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's log-probability and the most likely alternatives, from the raw logits."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # 1: the likeliest token; computed only where reported (prompt logprobs)


@dataclass(slots=True)
class TokenOutput:
    """One generated token as it leaves the engine (made once per token: not frozen, whose __init__ costs a
    setattr call per field; built positionally, as keywords cost more than twice as much)."""

    token_id: int
    text: str
    time_ms: float
    index: int
    finish_reason: StopCause | None = None
    matched_stop: str | None = None
    logprobs: TokenLogprobs | None = None
    batch_size: int = 1
    queue_wait_ms: float = 0.0
    prompt_logprobs: Any = None  # the first token's: pb.PromptLogprobs of prompt tokens 1 .. n-1, when asked


@dataclass
class Sequence:
    """A decode request from registration on: its tokens so far, its KV cache and its state."""

    request_id: str
    prompt_len: int
    sampling: SamplingParams
    max_seq_len: int
    prompt_token_ids: list[int] = field(default_factory=list)
    status: DecodeState = DecodeState.WAITING_FOR_BUDGET
    output_token_ids: list[int] = field(default_factory=list)
    # The transferred KV cache until the sequence joins the decode batch; opaque to the scheduler.
    pending_kv: Any = None
    # Its grammar's llguidance matcher, advanced over every token generated so far; None: unconstrained.
    matcher: Any = None
    # The sampler's running penalty counts (a PenaltyCounts), made at its first penalised step; None before.
    penalties: Any = None
    last_step_at: float = 0.0
    # Its KV blocks, and how many positions of prompt + output have KV in them.
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0
    # The prompt's images: their identities (and data, when prefilled here); the prompt as the prefix cache hashes it.
    media: tuple[MediaSpan, ...] = ()
    prepared_media: Any = None  # what the backend's prepare_media made of them (a local prefill's)
    prompt_cache_ids: list[int] = field(default_factory=list)
    lora: Any = None  # the LoRA adapter (a LoadedLora) every forward of it runs under; None: the base model
    # Speculative decoding: the client's switch, the coordinator's hint sequences, and its drafting state (a
    # speculative.drafter.DraftState, made at its first drafted step; None: it never drafted).
    no_drafts: bool = False
    draft_hints: tuple = ()
    drafts: Any = None
    # A continued stream: the prompt's last tokens whose text the client was not sent (DecodeRequest.held_text_tokens).
    held_text_tokens: int = 0

    def __post_init__(self):
        self.prompt_cache_ids = lora_cache_tokens(cache_token_ids(self.prompt_token_ids, self.media),
                                                  self.lora.ref.digest if self.lora else None)

    @property
    def cache_token_ids(self) -> list[int]:
        """Prompt and output so far as the prefix cache hashes them (under an adapter, the output salted as the
        prompt is: a conversation's next turn holds it as prompt)."""
        if self.lora is not None:
            return self.prompt_cache_ids + lora_cache_tokens(self.output_token_ids, self.lora.ref.digest)
        return self.prompt_cache_ids + self.output_token_ids

    @property
    def can_recompute(self) -> bool:
        """Whether this worker can compute its KV again after preemption: it has the prompt, and each image's file
        (a sequence whose cache came from a prefill worker has only their identities)."""
        return (bool(self.prompt_token_ids) or self.prompt_len == 0) and all(span.data for span in self.media)

    @property
    def num_generated(self) -> int:
        return len(self.output_token_ids)

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.num_generated

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output so far (the prompt only when the coordinator sent it)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_final
