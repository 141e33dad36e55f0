"""Triton: POST /v2/models/{model}/generate, /generate_stream (text) and /infer (token ids), seed 002."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from coordinator.apis.fields import INT32_MAX, MaxTokens, PositiveFloat, Seed, TgiTemperature, TopP, TypicalP
from coordinator.apis.tgi import FINISH_REASONS, textgen_sampling
from coordinator.errors import ApiError
from coordinator.request import Finished, SamplingOptions, TokenDelta
from coordinator.serving import SseFormatter, Transcript

REQUEST_ID = re.compile(r"^[A-Za-z0-9_-]{1,256}$")


def _top_k(v: int) -> int:
    if not 0 <= v <= INT32_MAX:
        raise ValueError(f"must be in [0, {INT32_MAX}], got {v}")
    return v


def _request_id(v: str | None) -> str | None:
    if v is not None and not REQUEST_ID.match(v):
        raise ValueError("must be 1 to 256 characters of A-Z, a-z, 0-9, '_' or '-'")
    return v


class TritonParameters(BaseModel):
    """`parameters` of a Triton request, with the seed's ranges."""

    model_config = ConfigDict(extra="forbid")

    details: bool = False
    do_sample: bool | None = None
    max_new_tokens: MaxTokens = 20
    repetition_penalty: PositiveFloat = 1.0
    seed: Seed | None = None
    temperature: TgiTemperature | None = None
    top_k: Annotated[int, AfterValidator(_top_k)] | None = None
    top_p: TopP | None = None
    batch_size: int = Field(1, gt=0, le=INT32_MAX)
    typical_p: TypicalP | None = None
    watermark: bool = False
    perf_stat: bool = False
    priority: int = Field(5, ge=1, le=5)
    timeout: float = Field(600, gt=0, le=3600)

    @model_validator(mode="after")
    def _unsupported(self):
        if self.watermark:
            raise ValueError("watermark is not supported: only false is accepted")
        if self.batch_size != 1:
            raise ValueError(f"batch_size={self.batch_size}: one input per request, so only 1 is accepted")
        return self

    def sampling(self) -> SamplingOptions:
        return textgen_sampling(self)


class TritonGenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: Annotated[str | None, AfterValidator(_request_id)] = None
    text_input: str | list = Field(min_length=1)
    parameters: TritonParameters = TritonParameters()


class TritonTensor(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=256)
    shape: list[int]
    datatype: Literal["UINT32"]
    data: list[int] = Field(min_length=1)

    @model_validator(mode="after")
    def _shape_matches_data(self):
        n = len(self.data)
        if self.shape not in ([n], [1, n]):
            raise ValueError(f"shape {self.shape} does not describe {n} values: use [{n}] or [1, {n}]")
        if any(not 0 <= t <= INT32_MAX for t in self.data):
            raise ValueError(f"data: token ids must be in [0, {INT32_MAX}]")
        return self


class TritonOutputSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)


class TritonInferRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: Annotated[str | None, AfterValidator(_request_id)] = None
    inputs: list[TritonTensor] = Field(min_length=1, max_length=1)
    outputs: list[TritonOutputSpec] = Field(min_length=1, max_length=1)
    parameters: TritonParameters = TritonParameters()

    @field_validator("inputs")
    @classmethod
    def _input0(cls, inputs: list[TritonTensor]) -> list[TritonTensor]:
        if inputs[0].name != "input0":
            raise ValueError(f"the input must be named 'input0', got {inputs[0].name!r}")
        return inputs


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise ApiError(404, f"model {requested!r} is not served here; this server serves {served!r}")


class TritonFormatter(SseFormatter):
    """Triton text responses: `text_output` plus details with per-token `perf_stat`."""

    def __init__(self, request_id: str, model: str, params: TritonParameters, full_text: bool):
        self.request_id = request_id
        self.model = model
        self.params = params
        self.full_text = full_text

    def _head(self, text: str) -> dict:
        return {"id": self.request_id, "model_name": self.model, "model_version": None, "text_output": text}

    @staticmethod
    def _perf_stat(deltas: list[TokenDelta]) -> list[list]:
        return [[d.token_id, round(d.time_ms, 3)] for d in deltas]

    def _costs(self, transcript: Transcript) -> dict:
        first = transcript.deltas[0].time_ms if transcript.deltas else None
        decode = sum(d.time_ms for d in transcript.deltas[1:])
        return {"first_token_cost": round(first, 3) if first is not None else None, "decode_cost": round(decode, 3)}

    def _stream_event(self, delta: TokenDelta, transcript: Transcript, finished: Finished | None) -> dict:
        details = {"generated_tokens": delta.index + 1, **self._costs(transcript),
                   "perf_stat": self._perf_stat(transcript.deltas), "batch_size": delta.batch_size,
                   "queue_wait_time": int(delta.queue_wait_ms * 1000)}
        if finished is not None:
            details = {"finish_reason": FINISH_REASONS[finished.reason], **details}
        first = delta.index == 0
        return {**self._head(transcript.text if self.full_text else delta.text), "details": details,
                "prefill_time": round(delta.time_ms, 3) if first else None,
                "decode_time": None if first else round(delta.time_ms, 3)}

    def token_frames(self, delta: TokenDelta, transcript: Transcript) -> list[dict]:
        return [] if delta.final else [self._stream_event(delta, transcript, None)]

    def final_frames(self, finished: Finished, transcript: Transcript) -> list[dict]:
        return [self._stream_event(transcript.deltas[-1], transcript, finished)]

    def error_frames(self, error: ApiError, transcript: Transcript) -> list[dict]:
        return [{"id": self.request_id, "error": error.message, "error_type": error.error_type}]

    def response(self, transcript: Transcript) -> dict:
        body = self._head(transcript.text)
        if self.params.details:
            finished = transcript.finished
            body["details"] = {"finish_reason": FINISH_REASONS[finished.reason],
                               "generated_tokens": finished.completion_tokens, **self._costs(transcript)}
            if self.params.perf_stat:
                body["details"]["perf_stat"] = self._perf_stat(transcript.deltas)
        return body


class TritonTokenFormatter(SseFormatter):
    """Triton /infer: the input ids followed by the generated ids, as one UINT32 tensor."""

    def __init__(self, request_id: str, request: TritonInferRequest):
        self.request_id = request_id
        self.request = request

    def token_frames(self, delta, transcript):
        return []

    def final_frames(self, finished, transcript):
        return []

    def error_frames(self, error, transcript):
        return [{"error": error.message, "error_type": error.error_type}]

    def response(self, transcript: Transcript) -> dict:
        data = self.request.inputs[0].data + transcript.token_ids
        return {"id": self.request_id, "outputs": [{"name": self.request.outputs[0].name, "shape": [1, len(data)],
                                                    "datatype": "UINT32", "data": data}]}
