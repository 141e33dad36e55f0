"""MindIE native POST /infer: stream and non-stream, `prefill_time` / `decode_time` per event (seed 002)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from coordinator.apis.fields import MaxTokens, OpenTopP, PositiveFloat, PositiveInt32, Seed, TgiTemperature, TypicalP
from coordinator.apis.tgi import FINISH_REASONS, textgen_sampling
from coordinator.errors import ApiError
from coordinator.request import Finished, SamplingOptions, TokenDelta
from coordinator.serving import SseFormatter, Transcript


class MindieParameters(BaseModel):
    """`parameters` of a MindIE /infer request, with the seed's ranges."""

    model_config = ConfigDict(extra="forbid")

    temperature: TgiTemperature | None = None
    top_k: PositiveInt32 | None = None
    top_p: OpenTopP | None = None
    max_new_tokens: MaxTokens = 20
    do_sample: bool | None = None
    seed: Seed | None = None
    repetition_penalty: PositiveFloat = 1.0
    details: bool = False
    typical_p: TypicalP = 1.0
    watermark: bool = False
    priority: int = Field(5, ge=1, le=5, description="1 highest ... 5 lowest")
    timeout: float = Field(600, gt=0, le=3600, description="seconds until the request is ended")

    @model_validator(mode="after")
    def _unsupported(self):
        if self.watermark:
            raise ValueError("watermark is not supported: only false is accepted")
        return self

    def sampling(self) -> SamplingOptions:
        return textgen_sampling(self)


class MindieRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inputs: str | list = Field(min_length=1)
    stream: bool = False
    parameters: MindieParameters = MindieParameters()


class MindieFormatter(SseFormatter):
    """Per token `{prefill_time, decode_time, token: {id: [id], text}}`; the last adds the result."""

    def __init__(self, params: MindieParameters, seed: int, full_text: bool):
        self.params = params
        self.seed = seed
        self.full_text = full_text

    def _details(self, finished: Finished) -> dict:
        return {"finish_reason": FINISH_REASONS[finished.reason], "generated_tokens": finished.completion_tokens,
                "seed": self.seed}

    def _event(self, delta: TokenDelta, text: str | None) -> dict:
        first = delta.index == 0
        return {"prefill_time": round(delta.time_ms, 3) if first else None,
                "decode_time": None if first else round(delta.time_ms, 3),
                "token": {"id": [delta.token_id], "text": text}}

    def token_frames(self, delta: TokenDelta, transcript: Transcript) -> list[dict]:
        if delta.final:
            return []  # written with the result by final_frames
        return [self._event(delta, transcript.text if self.full_text else delta.text)]

    def final_frames(self, finished: Finished, transcript: Transcript) -> list[dict]:
        # As in the seed, the last event's token has no text: generated_text carries all of it.
        event = self._event(transcript.deltas[-1], None)
        event["generated_text"] = transcript.text
        event["details"] = self._details(finished)
        return [event]

    def error_frames(self, error: ApiError, transcript: Transcript) -> list[dict]:
        return [{"error": error.message, "error_type": error.error_type}]

    def response(self, transcript: Transcript) -> dict:
        body = {"generated_text": transcript.text}
        if self.params.details:
            body["details"] = self._details(transcript.finished)
        return body
