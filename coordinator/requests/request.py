"""The one internal request and event types every client API maps onto."""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from coordinator.errors import ApiError
from adapters.peft_folder import AdapterRef
from kv_events.block_hash import lora_cache_tokens, media_cache_tokens
from proto.sampling import SamplingRules

if TYPE_CHECKING:
    from coordinator.tenancy.tenants import TenantTicket

DEFAULT_PRIORITY = 5  # the waiting line's levels: 1 first ... 5 last


@dataclass(frozen=True)
class GuidedGrammar:
    """A grammar the output must follow (llguidance's grammar text, checked to compile), and the tokens
    already generated under it by earlier attempts of the request."""

    grammar: str
    generated: tuple[int, ...] = ()


@dataclass(frozen=True)
class SamplingOptions(SamplingRules):
    """Validated sampling and stopping rules, in engine terms (top_k 0 = off), with the shared defaults."""

    logprobs: int | None = None  # None: no logprobs; N: the chosen token's and N alternatives
    prompt_logprobs: int | None = None  # as `logprobs`, for every prompt token after the first (with the first token)
    guided: GuidedGrammar | None = None
    seed_drawn: bool = False  # the coordinator drew `seed`: the client gave none


@dataclass(frozen=True, eq=False)
class MediaInput:
    """One image of a prompt, fetched: its file, its content hash, and the placeholder positions
    [offset, offset + num_tokens) its encoder output fills; `source`: the client's field."""

    kind: str
    data: bytes
    content_hash: int
    offset: int
    num_tokens: int
    source: str
    encoder: str = ""  # the encode worker holding its encoder output (requests/encoding.py): pulled, not encoded


@dataclass(frozen=True)
class NamedPrefill:
    """A prefill placed by the gateway's picker: the prefill worker ("": the decode worker prefills) and the peer it
    pulls the prompt's leading `pull_tokens` positions from ("": none)."""

    address: str = ""
    pull_from: str = ""
    pull_tokens: int = 0


@dataclass
class GenerationRequest:
    """A tokenized request, ready for routing. `max_tokens` None means the model default."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    max_tokens: int | None = None
    timeout_s: float | None = None  # the client's own deadline, on top of the configured ones
    priority: int | None = None  # 1 highest ... 5 lowest in the waiting line; None: the headers', else 5
    created: int = field(default_factory=lambda: int(time.time()))
    arrived_at: float = field(default_factory=time.monotonic)
    media: tuple[MediaInput, ...] = ()  # the prompt's images, in prompt order
    lora: AdapterRef | None = None  # the LoRA adapter it runs under; None: the base model
    ticket: TenantTicket | None = None  # its client request's hold on its tenant (tenancy/tenants.py)
    # Speculative decoding: earlier outputs the decode worker may draft from, each an encoded pb.DraftHint
    # (requests/draft_corpus.py), and whether the client turned drafting off (x-pdserve-speculative: off).
    draft_hints: tuple[bytes, ...] = ()
    no_drafts: bool = False
    held_text_tokens: int = 0  # a continuation: its prompt's last tokens whose text the client has not had yet
    # A sidecar's request (coordinator/gateway/sidecar.py): where the gateway's picker placed its prefill; None: the
    # router chooses, as a coordinator does.
    prefill_at: NamedPrefill | None = None

    def cache_token_ids(self, generated: list[int] = ()) -> list[int]:
        """The prompt, then the `generated` tokens, as the workers' prefix caches hash them (image placeholders
        stand for their content; under an adapter, every id salted with its identity)."""
        ids = media_cache_tokens(self.prompt_token_ids, self.media) if self.media else self.prompt_token_ids
        if generated:
            ids = ids + list(generated)
        return lora_cache_tokens(ids, self.lora.digest) if self.lora is not None else ids

    def with_encoders(self, encoders: dict[int, str]) -> GenerationRequest:
        """The request with each image in `encoders` (content hash → encode worker) named to be pulled from there;
        an image left out keeps no encoder: its file is sent."""
        if not self.media:
            return self
        if all(m.encoder == encoders.get(m.content_hash, "") for m in self.media):
            return self
        media = tuple(dataclasses.replace(m, encoder=encoders.get(m.content_hash, "")) for m in self.media)
        return dataclasses.replace(self, media=media)

    def continued(self, token_ids: list[int], attempt: int, held_text_tokens: int = 0) -> GenerationRequest:
        """The same request resumed on other workers after `token_ids` were already generated:
        those tokens join the prompt, and the rules that count generated tokens count them; the last
        `held_text_tokens` of them went out without their text, which the next worker sends."""
        if not token_ids and attempt == 0:
            return self
        guided = self.sampling.guided
        if guided is not None:
            guided = dataclasses.replace(guided, generated=guided.generated + tuple(token_ids))
        # Prompt logprobs came with the first token: a request continued after it does not ask again.
        sampling = dataclasses.replace(self.sampling, min_tokens=max(0, self.sampling.min_tokens - len(token_ids)),
                                       guided=guided,
                                       prompt_logprobs=self.sampling.prompt_logprobs if not token_ids else None)
        return dataclasses.replace(self, request_id=f"{self.request_id}.{attempt}",
                                   prompt_token_ids=self.prompt_token_ids + list(token_ids), sampling=sampling,
                                   held_text_tokens=held_text_tokens)


class FinishReason(enum.Enum):
    """Why generation ended, before each API names it in its own words."""

    EOS = "eos"
    STOP_STRING = "stop_string"
    STOP_TOKEN = "stop_token"
    LENGTH = "length"


@dataclass(slots=True)
class TokenDelta:
    """One generated token and the text it released (made once per streamed token: not frozen, whose
    __init__ costs a setattr call per field)."""

    token_id: int
    text: str
    index: int
    time_ms: float
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    final: bool = False  # the last token; a Finished event follows at once
    batch_size: int = 1  # decode batch that produced it
    queue_wait_ms: float = 0.0  # first token: admission wait; later: wait for the decode step
    choice: int = 0  # which of a response's generations it belongs to (n / best_of, a batch of prompts)
    # The first token's, when asked: (logprob, rank, ((token, logprob), ...)) of prompt tokens 1 .. n-1.
    prompt_logprobs: tuple | None = None


@dataclass(frozen=True)
class Finished:
    """The end of a successful generation."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    matched_stop: str | None = None
    prefill_time_ms: float = 0.0
    decode_time_ms: tuple[float, ...] = ()
    choice: int = 0  # as TokenDelta's

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Failed:
    """The end of a failed generation, as an event: how a response of several generations ends one of them while
    the others go on (a generation alone raises its ApiError)."""

    error: ApiError
    choice: int = 0


GenerationEvent = TokenDelta | Finished | Failed


class TokenListener(Protocol):
    """Takes a stream's tokens as their frames arrive, skipping the events' way through the request's task."""

    def take(self, token, to_delta: Callable[[object], TokenDelta]) -> bool:
        """Record a worker's token (`to_delta` makes it the request's TokenDelta) and queue its bytes, if it is not
        the last (finish_reason set) and can be written now, in order (the stream is open, its earlier events are
        all written, the client keeps up); False leaves it, untouched, to the request's task."""

    def flush(self) -> None:
        """Send the bytes `take` queued, in one write (called once per socket read that brought tokens)."""
