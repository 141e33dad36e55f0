"""vLLM's native POST /generate (a body with `prompt`): `{"text": [...]}`; streams end each object with NUL."""

from __future__ import annotations

import json
import secrets

from pydantic import BaseModel, ConfigDict, Field

from coordinator.apis.fields import (
    MaxTokens,
    Penalty,
    RepetitionPenalty,
    Seed,
    Stop,
    Temperature,
    TokenIds,
    TopK,
    TopP,
)
from coordinator.errors import ApiError
from coordinator.request import Finished, SamplingOptions, TokenDelta
from coordinator.serving import Transcript


class VllmGenerateRequest(BaseModel):
    """The body of vLLM's /generate, with the seed's ranges."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    prompt: str | list = Field(min_length=1)
    max_tokens: MaxTokens | None = None
    repetition_penalty: RepetitionPenalty = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    seed: Seed | None = None
    stream: bool = False
    stop: Stop = None
    stop_token_ids: TokenIds = None
    model: str | None = None  # a LoRA id in the seed; only the served model (or "None") is accepted
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False

    def sampling(self) -> SamplingOptions:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingOptions(
            temperature=self.temperature, top_p=self.top_p, top_k=0 if self.top_k == -1 else self.top_k,
            seed=self.seed if self.seed is not None else secrets.randbits(63) + 1, stop=stop,
            skip_special_tokens=self.skip_special_tokens, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


def check_lora(model: str | None, served: str) -> None:
    if model not in (None, "None", served):
        raise ApiError(400, f"model={model!r}: LoRA adapters are not supported; send \"None\" or {served!r}",
                       param="model")


class VllmFormatter:
    """One `{"text": [...]}` object per token, each followed by a NUL byte, as vLLM streams."""

    done_marker = None
    stream_content_type = "application/json"

    def __init__(self, prompt: str, full_text: bool):
        self.prompt = prompt
        self.full_text = full_text

    def encode(self, frame: dict | str) -> bytes:
        return json.dumps(frame, ensure_ascii=False).encode("utf-8") + b"\0"

    def token_frames(self, delta: TokenDelta, transcript: Transcript) -> list[dict]:
        return [{"text": [transcript.text if self.full_text else delta.text]}]

    def final_frames(self, finished: Finished, transcript: Transcript) -> list[dict]:
        return []

    def error_frames(self, error: ApiError, transcript: Transcript) -> list[dict]:
        return [{"error": error.message, "error_type": error.error_type}]

    def response(self, transcript: Transcript) -> dict:
        # As the seed's example shows, the answer repeats the prompt before the generated text.
        return {"text": [self.prompt + transcript.text]}
