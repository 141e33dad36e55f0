"""TGI text generation: POST /generate and /generate_stream (seed 002), and POST / for TGI clients.

`POST /` is what `huggingface_hub.InferenceClient(base_url=...)` calls, with `stream` in the body;
it answers in real TGI's shapes (token `id` an int). `/generate_stream` follows the seed, whose
stream token `id` is a one-element list.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from coordinator.apis.fields import (
    MaxTokens,
    OpenTopP,
    PositiveFloat,
    PositiveInt32,
    Seed,
    TgiTemperature,
    TypicalP,
    new_id,
    new_seed,
    stop_tuple,
)
from coordinator.errors import ApiError
from coordinator.request import Finished, FinishReason, SamplingOptions, TokenDelta
from coordinator.serving import SseFormatter, Transcript

STOP_ITEM_CHARS = 1024
STOP_MAX_ITEMS = 1024
STOP_TOTAL_CHARS = 32768


def _stop(v: str | list[str] | None) -> str | list[str] | None:
    items = [v] if isinstance(v, str) else (v or [])
    if len(items) > STOP_MAX_ITEMS:
        raise ValueError(f"at most {STOP_MAX_ITEMS} stop strings, got {len(items)}")
    if any(not 1 <= len(s) <= STOP_ITEM_CHARS for s in items):
        raise ValueError(f"every stop string must have 1 to {STOP_ITEM_CHARS} characters")
    if sum(len(s) for s in items) > STOP_TOTAL_CHARS:
        raise ValueError(f"stop strings may have at most {STOP_TOTAL_CHARS} characters in total")
    return v


def textgen_sampling(params, **extra) -> SamplingOptions:
    """TGI-family sampling (TGI, MindIE, Triton): greedy unless do_sample, or a sampling
    parameter, asks for sampling; `do_sample: false` is greedy whatever else is set."""
    wants_sampling = params.do_sample if params.do_sample is not None else any(
        v is not None for v in (params.temperature, params.top_k, params.top_p))
    return SamplingOptions(
        temperature=(params.temperature or 1.0) if wants_sampling else 0.0,
        top_p=params.top_p or 1.0, top_k=params.top_k or 0, seed=new_seed(params.seed),
        repetition_penalty=params.repetition_penalty, **extra,
    )


class TgiParameters(BaseModel):
    """`parameters` of a TGI request, with the seed's ranges."""

    model_config = ConfigDict(extra="forbid")

    decoder_input_details: bool = False
    details: bool = False
    do_sample: bool | None = None
    max_new_tokens: MaxTokens = 20
    repetition_penalty: PositiveFloat = 1.0
    return_full_text: bool = False
    seed: Seed | None = None
    temperature: TgiTemperature | None = None
    top_k: PositiveInt32 | None = None
    top_p: OpenTopP | None = None
    truncate: PositiveInt32 | None = None
    typical_p: TypicalP = 1.0
    watermark: bool = False
    stop: Annotated[str | list[str] | None, AfterValidator(_stop)] = None
    adapter_id: str = "None"

    @model_validator(mode="after")
    def _unsupported(self):
        if self.watermark:
            raise ValueError("watermark is not supported: only false is accepted")
        if self.adapter_id not in ("None", ""):
            raise ValueError(f"adapter_id={self.adapter_id!r}: LoRA adapters are not supported")
        return self

    def sampling(self) -> SamplingOptions:
        # logprobs=0: TGI reports each token's logprob.
        return textgen_sampling(self, stop=stop_tuple(self.stop), logprobs=0)


class TgiRequest(BaseModel):
    """A TGI request body; `stream` is only read on `POST /`."""

    model_config = ConfigDict(extra="forbid")

    inputs: str | list = Field(min_length=1)
    parameters: TgiParameters = TgiParameters()
    stream: bool = False

    @model_validator(mode="after")
    def _stream_without_prefill_details(self):
        if self.stream and self.parameters.decoder_input_details:
            raise ValueError("decoder_input_details must be false when streaming")
        return self


FINISH_REASONS = {
    FinishReason.EOS: "eos_token",
    FinishReason.STOP_STRING: "stop_sequence",
    FinishReason.STOP_TOKEN: "stop_sequence",
    FinishReason.LENGTH: "length",
}


class TgiFormatter(SseFormatter):
    """TGI responses; `list_ids` writes stream token ids as `[id]`, as the seed does."""

    def __init__(self, request: TgiRequest, prompt_text: str, prompt_token_ids: list[int], seed: int,
                 full_text: bool, token_text: Callable[[int], str], special_ids: frozenset[int], list_ids: bool,
                 wrap_in_list: bool = False):
        self.request = request
        self.params = request.parameters
        self.prompt_text = prompt_text
        self.prompt_token_ids = prompt_token_ids
        self.seed = seed
        self.full_text = full_text
        self.token_text = token_text
        self.special_ids = special_ids
        self.list_ids = list_ids
        self.wrap_in_list = wrap_in_list

    def _token(self, token_id: int, text: str, logprob: float | None) -> dict:
        return {"id": token_id, "text": text, "logprob": logprob, "special": token_id in self.special_ids}

    def _generated_text(self, transcript: Transcript) -> str:
        return (self.prompt_text if self.params.return_full_text else "") + transcript.text

    def token_frames(self, delta: TokenDelta, transcript: Transcript) -> list[dict]:
        # The last token's event also carries generated_text and details: written at the finish.
        return [] if delta.final else [self._stream_event(delta, transcript, None)]

    def _stream_event(self, delta: TokenDelta, transcript: Transcript, finished: Finished | None) -> dict:
        token = self._token(delta.token_id, transcript.text if self.full_text else delta.text, delta.logprob)
        if self.list_ids:
            token["id"] = [delta.token_id]
        event = {"token": token, "generated_text": None, "details": None}
        if finished is not None:
            event["generated_text"] = self._generated_text(transcript)
            if self.params.details:
                event["details"] = {"prompt_tokens": finished.prompt_tokens,
                                    "finish_reason": FINISH_REASONS[finished.reason],
                                    "generated_tokens": finished.completion_tokens, "seed": self.seed}
        return event

    def final_frames(self, finished: Finished, transcript: Transcript) -> list[dict]:
        return [self._stream_event(transcript.deltas[-1], transcript, finished)]

    def error_frames(self, error: ApiError, transcript: Transcript) -> list[dict]:
        return [{"error": error.message, "error_type": error.error_type}]

    def response(self, transcript: Transcript) -> dict | list:
        finished = transcript.finished
        body: dict = {"generated_text": self._generated_text(transcript)}
        if self.params.details or self.params.decoder_input_details:
            prefill = []
            if self.params.decoder_input_details:
                prefill = [self._token(t, self.token_text(t), None) for t in self.prompt_token_ids]
            body["details"] = {
                "finish_reason": FINISH_REASONS[finished.reason],
                "generated_tokens": finished.completion_tokens,
                "prefill": prefill,
                "prompt_tokens": finished.prompt_tokens,
                "seed": self.seed,
                "tokens": [self._token(d.token_id, self.token_text(d.token_id), d.logprob) for d in transcript.deltas],
            }
        return [body] if self.wrap_in_list else body


def new_request_id() -> str:
    return new_id("tgi")
