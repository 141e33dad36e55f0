"""The bodies the predict port answers with, as pydantic models: what GET /openapi.json documents.

The formatters build plain dicts; these models only describe them. They are exact where a shape is
fixed (a TGI token, an error body) and allow extra keys where it grows with options or versions
(top-level responses, choices). A field that may be absent has a default; one that is always sent,
even as null, has none. The system test (tests/coordinator/apis/test_openapi.py) checks real responses
against them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from coordinator.http.route_table import ErrorStyle


@dataclass(frozen=True)
class Reply:
    """A route's success answers: a JSON body, a stream of events, or a text body."""

    json: Any = None  # the type of a JSON body (a model, or a union of models)
    events: Any = None  # the type of one text/event-stream event's JSON `data`
    done_marker: str | None = None  # a stream's last `data:` that is not JSON (OpenAI's [DONE])
    text: str | None = None  # the media type of a text body (Prometheus)
    statuses: tuple[int, ...] = (200,)  # the statuses that answer with these bodies (health: 200 and 503)
    description: str = ""  # what the success answer is, when the bodies alone do not say


class Exact(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# Error bodies (error_response.ERROR_BODIES), one per ErrorStyle.

class ErrorInfo(Open):
    """BladeLLM's `error_info` (docs/compatibility.md): null, or the failure's code and message."""

    code: int | str | None = None
    message: str | None = None


class OpenAIErrorDetail(Exact):
    message: str
    type: str
    param: str | None
    code: int


class OpenAIErrorBody(Exact):
    """An OpenAI-style error: 4xx and 5xx answers of OpenAI routes."""

    error: OpenAIErrorDetail
    error_info: ErrorInfo | None = None


class TextGenErrorBody(Exact):
    """A TGI-style error: 4xx and 5xx answers of the TGI, vLLM, Triton, MindIE and tokenizer routes,
    and the last event of their streams after a late failure."""

    error: str
    error_type: str


ERROR_BODY_MODELS: dict[ErrorStyle, type[BaseModel]] = {
    ErrorStyle.OPENAI: OpenAIErrorBody,
    ErrorStyle.TGI: TextGenErrorBody,
}


# OpenAI chat and completions.

class Usage(Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class FunctionCall(Open):
    name: str
    arguments: str  # JSON text


class ToolCall(Open):
    id: str
    type: Literal["function"]
    function: FunctionCall


class StreamedToolCall(ToolCall):
    index: int


class LogprobEntry(Open):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(LogprobEntry):
    top_logprobs: list[LogprobEntry]


class ChatLogprobs(Open):
    content: list[TokenLogprob] | None


class ChatMessageOut(Open):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(Open):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    token_ids: list[int] | None = None


class ChatCompletion(Open):
    """A chat completion (non-stream)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prefill_time: float | None = Field(None, description="ms to the first token")
    decode_time_arr: list[float] | None = Field(None, description="ms per later token")
    prompt_token_ids: list[int] | None = None
    error_info: ErrorInfo | None = None


class ChatDelta(Open):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[StreamedToolCall] | None = None


class ChatChunkChoice(Open):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    token_ids: list[int] | None = None


class ChatCompletionChunk(Open):
    """One streamed chat event; `usage` on the last (and on every one with continuous_usage_stats), an
    `error` on a stream's last event after a late failure, no choices in include_usage's usage chunk."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
    full_text: str | None = Field(None, description="fullTextEnabled: the whole output, on the last chunk")
    error: OpenAIErrorDetail | None = None
    error_info: ErrorInfo | None = None


class CompletionLogprobs(Open):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None] | None


class CompletionChoice(Open):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class Completion(Open):
    """A text completion, whole or one streamed event (streamed events carry no usage until the last; an
    `error` on a stream's last event after a late failure)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    full_text: str | None = None
    error: OpenAIErrorDetail | None = None
    error_info: ErrorInfo | None = None


# TGI.

class TgiToken(Exact):
    id: int
    text: str
    logprob: float | None
    special: bool


class TgiDetails(Open):
    finish_reason: Literal["eos_token", "stop_sequence", "length"]
    generated_tokens: int
    prompt_tokens: int
    seed: int | None
    prefill: list[TgiToken] = []
    tokens: list[TgiToken] = []


class TgiResponse(Exact):
    """TGI's answer: `details` when parameters.details (or decoder_input_details) is set."""

    generated_text: str
    details: TgiDetails | None = None


class TgiStreamDetails(Open):
    finish_reason: Literal["eos_token", "stop_sequence", "length"]
    generated_tokens: int
    prompt_tokens: int
    seed: int | None


class TgiStreamToken(Exact):
    id: int | list[int] = Field(
        description="[id] on /generate_stream (as the MindIE coordinator API shows it), id on POST /")
    text: str
    logprob: float | None
    special: bool


class TgiStreamEvent(Exact):
    """One streamed token; the last event also carries generated_text (and details if asked for)."""

    token: TgiStreamToken
    generated_text: str | None
    details: TgiStreamDetails | None


# vLLM native.

class VllmResponse(Exact):
    """vLLM's /generate answer: the prompt followed by the generated text."""

    text: list[str]


# Triton.

class TritonDetails(Open):
    finish_reason: Literal["eos_token", "stop_sequence", "length"] | None = None
    generated_tokens: int
    first_token_cost: float | None = Field(None, description="ms")
    decode_cost: float | None = Field(None, description="ms")
    perf_stat: list[tuple[int, float]] | None = Field(None, description="[token id, ms] per token")
    batch_size: int | None = None
    queue_wait_time: int | None = Field(None, description="microseconds")


class TritonResponse(Open):
    """A Triton text answer, whole or one streamed event (then with prefill_time / decode_time in ms)."""

    id: str
    model_name: str
    model_version: str | None
    text_output: str
    details: TritonDetails | None = None
    prefill_time: float | None = None
    decode_time: float | None = None


class TritonStreamError(TextGenErrorBody):
    """A Triton stream's last event after a late failure."""

    id: str


class TritonTensorOut(Exact):
    name: str
    shape: list[int]
    datatype: Literal["UINT32"]
    data: list[int]


class TritonInferResponse(Exact):
    """Triton token inference: the prompt's ids followed by the generated ids."""

    id: str
    outputs: list[TritonTensorOut]


# MindIE.

class MindieDetails(Open):
    finish_reason: Literal["eos_token", "stop_sequence", "length"]
    generated_tokens: int
    seed: int | None


class MindieResponse(Exact):
    generated_text: str
    details: MindieDetails | None = None


class MindieToken(Exact):
    id: list[int]
    text: str | None


class MindieStreamEvent(Exact):
    """One streamed token; the last event also carries generated_text and details."""

    prefill_time: float | None = Field(description="ms, on the first event")
    decode_time: float | None = Field(description="ms, on later events")
    token: MindieToken
    generated_text: str | None = None
    details: MindieDetails | None = None


# Tokenizer and operations.

class TokenizeResponse(Exact):
    token_number: int
    tokens: list[str]


class ModelCard(Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(Open):
    object: Literal["list"]
    data: list[ModelCard]


class EtcdHealth(Exact):
    """etcd as this coordinator last reached it (backup_config)."""

    reachable: bool
    since: float | None = Field(description="Unix time of the first failed call of the current outage")
    error: str = Field(description="Why the last call failed; empty while reachable")
    endpoints: list[str]


class Health(Exact):
    """200 while a prefill and a decode instance are routable ("degraded" if some others are not), else 503;
    with backup_config, also this coordinator's role (a standby answers 503) and etcd's reachability."""

    status: Literal["healthy", "degraded", "unhealthy"]
    instances: dict[str, dict[str, str]] = Field(description="role -> instance address -> state")
    role: Literal["active", "standby", "replica"] = Field(None, description="With etcd: whether this "
                                                          "coordinator serves clients (active, replica)")
    coordinator: str = Field(None, description="With etcd: this coordinator's name")
    leader: str = Field(None, description="With etcd: the active coordinator, as last seen")
    etcd: EtcdHealth = Field(None, description="With etcd: its reachability")
    replicas: int = Field(None, description="With etcd in mode replicas: the coordinators serving, each taking "
                          "1/replicas of every tenant's limits")


class Liveness(Exact):
    """200 while the process serves (a liveness probe: it says nothing of the workers or of etcd)."""

    status: Literal["alive"]


class OpenApiDocument(Open):
    """This document."""

    openapi: str
    info: dict[str, Any]
    paths: dict[str, Any]
