"""Triton: POST /v2/models/{model}/generate, /generate_stream (text) and /infer (token ids), the MindIE API
(docs/compatibility.md)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from aiohttp import web
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from coordinator.apis.fields import INT32_MAX, PromptInput, TopP, new_id, read_request
from coordinator.apis.prompts import tokenize_input
from coordinator.apis.response_models import Reply, TritonInferResponse, TritonResponse, TritonStreamError
from coordinator.http.route_table import ErrorStyle, Route
from coordinator.apis.tgi_family import (
    QueuedParameters,
    TextGenFormatter,
    TypicalP,
    error_frame,
    finish_details,
    token_timing,
)
from coordinator.errors import ApiError
from adapters.peft_folder import AdapterRef
from coordinator.requests.request import Finished, TokenDelta
from coordinator.requests.serving import SseFormatter, Transcript, serve_generation
from coordinator.state import STATE

REQUEST_ID = re.compile(r"^[A-Za-z0-9_-]{1,256}$")


def _top_k(v: int) -> int:
    if not 0 <= v <= INT32_MAX:
        raise ValueError(f"must be in [0, {INT32_MAX}], got {v}")
    return v


def _request_id(v: str | None) -> str | None:
    if v is not None and not REQUEST_ID.match(v):
        raise ValueError("must be 1 to 256 characters of A-Z, a-z, 0-9, '_' or '-'")
    return v


RequestId = Annotated[str | None, AfterValidator(_request_id)]


class TritonParameters(QueuedParameters):
    """`parameters` of a Triton request, with the ranges of the MindIE API, docs/compatibility.md (Triton's top_k,
    top_p and typical_p differ)."""

    top_k: Annotated[int, AfterValidator(_top_k)] | None = None
    top_p: TopP | None = None
    typical_p: TypicalP | None = None
    batch_size: int = Field(1, gt=0, le=INT32_MAX)
    perf_stat: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if self.batch_size != 1:
            raise ValueError(f"batch_size={self.batch_size}: one input per request, so only 1 is accepted")
        return self


class TritonGenerateRequest(BaseModel):
    """The body of a Triton text request."""

    model_config = ConfigDict(extra="forbid")

    id: RequestId = None
    text_input: PromptInput
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
    """The body of a Triton token request: one UINT32 tensor of prompt token ids."""

    model_config = ConfigDict(extra="forbid")

    id: RequestId = None
    inputs: list[TritonTensor] = Field(min_length=1, max_length=1)
    outputs: list[TritonOutputSpec] = Field(min_length=1, max_length=1)
    parameters: TritonParameters = TritonParameters()

    @field_validator("inputs")
    @classmethod
    def _input0(cls, inputs: list[TritonTensor]) -> list[TritonTensor]:
        if inputs[0].name != "input0":
            raise ValueError(f"the input must be named 'input0', got {inputs[0].name!r}")
        return inputs


class TritonFormatter(TextGenFormatter):
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

    def stream_event(self, delta: TokenDelta, transcript: Transcript, finished: Finished | None) -> dict:
        details = {"generated_tokens": delta.index + 1, **self._costs(transcript),
                   "perf_stat": self._perf_stat(transcript.deltas), "batch_size": delta.batch_size,
                   "queue_wait_time": int(delta.queue_wait_ms * 1000)}
        if finished is not None:
            details = {**finish_details(finished), **details}
        return {**self._head(self.streamed_text(delta, transcript)), "details": details, **token_timing(delta)}

    def error_frames(self, error: ApiError, transcript: Transcript) -> list[dict]:
        return [{"id": self.request_id, **error_frame(error)}]

    def response(self, transcript: Transcript) -> dict:
        body = self._head(transcript.text)
        if self.params.details:
            body["details"] = {**finish_details(transcript.finished), **self._costs(transcript)}
            if self.params.perf_stat:
                body["details"]["perf_stat"] = self._perf_stat(transcript.deltas)
        return body


class TritonTokenFormatter(SseFormatter):
    """Triton /infer: the input ids followed by the generated ids, as one UINT32 tensor; never streamed."""

    def __init__(self, request_id: str, request: TritonInferRequest):
        self.request_id = request_id
        self.request = request

    def token_frames(self, delta, transcript):
        return []

    def final_frames(self, finished, transcript):
        return []

    def error_frames(self, error, transcript):
        return [error_frame(error)]

    def response(self, transcript: Transcript) -> dict:
        data = self.request.inputs[0].data + transcript.token_ids
        return {"id": self.request_id, "outputs": [{"name": self.request.outputs[0].name, "shape": [1, len(data)],
                                                    "datatype": "UINT32", "data": data}]}


def triton_adapter(state, model: str, adapter_id: str = "None") -> AdapterRef | None:
    """The adapter a Triton request runs under: the model in its path (an adapter's name selects it), or
    `parameters.adapter_id`; both naming different adapters is a 400."""
    by_path = state.loras.select(model, "model")
    by_field = state.loras.select(adapter_id, "parameters.adapter_id")
    if by_path is not None and by_field is not None and by_path != by_field:
        raise ApiError(400, f"parameters.adapter_id={adapter_id!r} differs from the model in the path ({model!r})",
                       param="parameters.adapter_id")
    return by_path or by_field


async def generate(request: web.Request) -> web.StreamResponse:
    """Triton text generation; `/generate_stream` streams."""
    state = request.app[STATE]
    req = await read_request(request, TritonGenerateRequest)
    lora = triton_adapter(state, request.match_info["model"], req.parameters.adapter_id)
    prompt = await tokenize_input(state, req.text_input, "text_input")
    # The client's id is only echoed: two clients may choose the same one, so workers key on ours.
    gen = req.parameters.generation(new_id("triton"), prompt.token_ids, media=prompt.media, lora=lora)
    formatter = TritonFormatter(req.id or gen.request_id, lora.name if lora else state.model_name, req.parameters,
                                state.full_text)
    stream = request.path.endswith("/generate_stream")
    return await serve_generation(request, state.pipeline, gen, formatter, stream)


async def infer(request: web.Request) -> web.Response:
    """Triton token inference: token ids in, token ids out."""
    state = request.app[STATE]
    req = await read_request(request, TritonInferRequest)
    lora = triton_adapter(state, request.match_info["model"], req.parameters.adapter_id)
    prompt_ids = req.inputs[0].data
    vocab = len(state.tokenizer.tokenizer)
    if max(prompt_ids) >= vocab:
        raise ApiError(400, f"inputs.0.data: token id {max(prompt_ids)} is outside the vocabulary [0, {vocab})",
                       param="inputs")
    state.limits.check_prompt(len(prompt_ids), "inputs.0.data")
    gen = req.parameters.generation(new_id("triton"), list(prompt_ids), lora=lora)
    return await serve_generation(request, state.pipeline, gen, TritonTokenFormatter(req.id or gen.request_id, req),
                                  False)


ROUTES = [
    Route("POST", "/v2/models/{model}/generate", generate, ErrorStyle.TGI, "triton", generation=True,
          body_model=TritonGenerateRequest, reply=Reply(json=TritonResponse)),
    Route("POST", "/v2/models/{model}/generate_stream", generate, ErrorStyle.TGI, "triton", generation=True,
          body_model=TritonGenerateRequest, reply=Reply(events=TritonResponse | TritonStreamError)),
    Route("POST", "/v2/models/{model}/infer", infer, ErrorStyle.TGI, "triton", generation=True,
          body_model=TritonInferRequest, reply=Reply(json=TritonInferResponse)),
]
