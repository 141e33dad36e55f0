"""What the TGI family shares: TGI, MindIE and Triton their parameter fields and ranges, the sampling
rule, finish reasons and the model check; vLLM's native API too, the `{error, error_type}` error frame."""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, model_validator

from coordinator.apis.fields import MaxTokens, PositiveInt32, Seed, seed_fields
from coordinator.errors import ApiError
from coordinator.requests.request import (Finished, FinishReason, GenerationRequest, GuidedGrammar, SamplingOptions,
                                         TokenDelta)
from coordinator.requests.serving import SseFormatter, Transcript


# The family states some ranges differently from OpenAI/vLLM.
def _positive(v: float) -> float:
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"must be > 0.0, got {v}")
    return v


def _temperature(v: float) -> float:
    if not math.isfinite(v) or v <= 1e-6:
        raise ValueError(f"must be > 1e-6, got {v}")
    return v


def _open_top_p(v: float) -> float:
    if not 1e-6 < v < 1.0:
        raise ValueError(f"must be in (1e-6, 1.0), got {v}")
    return v


def _typical_p(v: float) -> float:
    # TGI's rule, > 0.0 and < 1.0, with 1.0 (off) accepted as the MindIE coordinator API's range has it.
    if not 0.0 < v <= 1.0:
        raise ValueError(f"must be in (0.0, 1.0] (1.0: off), got {v}")
    return v


PositiveFloat = Annotated[float, AfterValidator(_positive)]
TextGenTemperature = Annotated[float, AfterValidator(_temperature)]
OpenTopP = Annotated[float, AfterValidator(_open_top_p)]
TypicalP = Annotated[float, AfterValidator(_typical_p)]

FINISH_REASONS = {
    FinishReason.EOS: "eos_token",
    FinishReason.STOP_STRING: "stop_sequence",
    FinishReason.STOP_TOKEN: "stop_sequence",
    FinishReason.LENGTH: "length",
}


class TextGenParameters(BaseModel):
    """`parameters` fields the TGI family shares, with the ranges of the MindIE API (docs/compatibility.md); unknown
    fields are refused."""

    model_config = ConfigDict(extra="forbid")

    details: bool = False
    do_sample: bool | None = None
    max_new_tokens: MaxTokens = 20
    repetition_penalty: PositiveFloat = 1.0
    seed: Seed | None = None
    temperature: TextGenTemperature | None = None
    top_k: PositiveInt32 | None = None
    top_p: OpenTopP | None = None
    typical_p: TypicalP = 1.0
    watermark: bool = False
    # The LoRA adapter to run under (its served name); "None": the base model.
    adapter_id: Annotated[str, StringConstraints(max_length=256, pattern=r"^[A-Za-z0-9./_-]*$")] = "None"

    @model_validator(mode="after")
    def _no_watermark(self):
        if self.watermark:
            raise ValueError("watermark is not supported: only false is accepted")
        return self

    def sampling(self, **extra) -> SamplingOptions:
        """Greedy unless do_sample, or a sampling parameter (typical_p below 1.0 included, as in TGI), asks for
        sampling; `do_sample: false` is greedy whatever else is set, typical_p then dropped."""
        typical_p = self.typical_p if self.typical_p is not None else 1.0
        wants_sampling = self.do_sample if self.do_sample is not None else (
            any(v is not None for v in (self.temperature, self.top_k, self.top_p)) or typical_p < 1.0)
        return SamplingOptions(
            temperature=(self.temperature or 1.0) if wants_sampling else 0.0,
            top_p=self.top_p or 1.0, top_k=self.top_k or 0, typical_p=typical_p if wants_sampling else 1.0,
            **seed_fields(self.seed), repetition_penalty=self.repetition_penalty, **extra,
        )

    def generation(self, request_id: str, prompt_ids: list[int], guided: GuidedGrammar | None = None,
                   **extra) -> GenerationRequest:
        return GenerationRequest(request_id, prompt_ids, self.sampling(guided=guided), self.max_new_tokens, **extra)


class QueuedParameters(TextGenParameters):
    """Parameters of the APIs that also set the request's queue priority and deadline (MindIE, Triton)."""

    priority: int = Field(5, ge=1, le=5, description="1 highest ... 5 lowest")
    timeout: float = Field(600, gt=0, le=3600, description="seconds until the request is ended")

    def generation(self, request_id: str, prompt_ids: list[int], **extra) -> GenerationRequest:
        # A priority the body leaves out may come from the priority headers (tenancy/admission.py).
        priority = self.priority if "priority" in self.model_fields_set else None
        return super().generation(request_id, prompt_ids, timeout_s=self.timeout, priority=priority, **extra)


def error_frame(error: ApiError) -> dict:
    """The family's error body, also a stream's last event after a late failure."""
    return {"error": error.message, "error_type": error.error_type}


def finish_details(finished: Finished) -> dict:
    return {"finish_reason": FINISH_REASONS[finished.reason], "generated_tokens": finished.completion_tokens}


def token_timing(delta: TokenDelta) -> dict:
    """`prefill_time` (ms) on the first token's event, `decode_time` (ms) on later ones."""
    first = delta.index == 0
    return {"prefill_time": round(delta.time_ms, 3) if first else None,
            "decode_time": None if first else round(delta.time_ms, 3)}


class TextGenFormatter(SseFormatter):
    """One event per token; the last token's event is written at the finish, with the result."""

    full_text = False  # fullTextEnabled: each event carries the text so far

    def streamed_text(self, delta: TokenDelta, transcript: Transcript) -> str:
        return transcript.text if self.full_text else delta.text

    def stream_event(self, delta: TokenDelta, transcript: Transcript, finished: Finished | None) -> dict:
        raise NotImplementedError

    def token_frames(self, delta: TokenDelta, transcript: Transcript) -> list[dict]:
        return [] if delta.final else [self.stream_event(delta, transcript, None)]

    def final_frames(self, finished: Finished, transcript: Transcript) -> list[dict]:
        return [self.stream_event(transcript.deltas[-1], transcript, finished)]

    def error_frames(self, error: ApiError, transcript: Transcript) -> list[dict]:
        return [error_frame(error)]
