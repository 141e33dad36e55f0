"""What OpenAI chat and completions share: field ranges, sampling mapping, usage, errors."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, model_validator

from coordinator.apis.fields import MinTokens, TokenIds, VllmSamplingFields
from coordinator.apis.guided import GuidedFields
from coordinator.requests.choices import fan_out, serve_choices
from coordinator.errors import ApiError
from coordinator.requests.request import (Finished, FinishReason, GenerationRequest, GuidedGrammar, SamplingOptions,
                                         TokenDelta)
from coordinator.requests.serving import SseFormatter
from coordinator.http.sse import ChunkTemplate
from coordinator.state import STATE

# Fields real clients send that later work will honour; until then a non-default value is a
# clear 400, never silently ignored. Values listed are the defaults that change nothing.
NOT_YET_SUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None,),
}


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`, with vLLM's `continuous_usage_stats`."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class OpenAIRequest(GuidedFields, VllmSamplingFields):
    """Fields common to chat and completions, each validated against its range in the MindIE API
    (docs/compatibility.md)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    stream: bool = False
    min_tokens: MinTokens = 0
    n: int = Field(1, ge=1, le=128)
    best_of: int | None = Field(None, ge=1, le=128)
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    user: str | None = None  # end-user id for the operator's logs; does not affect generation
    stop_tokens: TokenIds = None  # BladeLLM's name for stop_token_ids (docs/compatibility.md)
    # vLLM's: each prompt token's logprob (after the first) with this many alternatives, in `prompt_logprobs`.
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False  # return the prompt with the result (BladeLLM, OpenAI completions)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, defaults in NOT_YET_SUPPORTED.items():
            if name in data and name not in cls.model_fields:
                value = data[name]
                if not any(value == d and type(value) is type(d) for d in defaults):
                    raise ValueError(f"{name} is not supported by this server yet")
        return {k: v for k, v in data.items() if k not in NOT_YET_SUPPORTED or k in cls.model_fields}

    @model_validator(mode="after")
    def _best_of_covers_n(self):
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of={self.best_of} must be >= n={self.n}")
        if self.stream and self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"when streaming, best_of ({self.best_of}) must equal n ({self.n})")
        return self

    @property
    def num_generations(self) -> int:
        return self.best_of or self.n

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _one_stop_token_list(self):
        if self.stop_tokens is not None:
            if self.stop_token_ids is not None and self.stop_token_ids != self.stop_tokens:
                raise ValueError(f"stop_token_ids={self.stop_token_ids} and stop_tokens={self.stop_tokens} "
                                 "disagree; send one of them")
            self.stop_token_ids = self.stop_tokens
        return self

    @model_validator(mode="after")
    def _min_tokens_within_max_tokens(self):
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}")
        return self

    def logprobs_count(self) -> int | None:
        """How many alternatives per token the client asked for; None for no logprobs."""
        return None

    def prompt_logprobs_count(self) -> int | None:
        """How many alternatives per prompt token the answer shows; None: no prompt logprobs."""
        return self.prompt_logprobs

    def sampling(self, guided: GuidedGrammar | None = None) -> SamplingOptions:
        """The request's sampling (with its checked grammar); with best_of > n, logprobs rank the candidates."""
        sampling = super().sampling(min_tokens=self.min_tokens, logprobs=self.logprobs_count(), guided=guided,
                                    prompt_logprobs=self.prompt_logprobs_count())
        if self.num_generations > self.n and sampling.logprobs is None:
            sampling = dataclasses.replace(sampling, logprobs=0)
        return sampling


def finish_reason(finished: Finished) -> str:
    return "length" if finished.reason is FinishReason.LENGTH else "stop"


def stop_reason(finished: Finished | None) -> str | int | None:
    """vLLM's `stop_reason`: the stop string, or the stop token id, that ended the output."""
    if finished is None or finished.matched_stop is None:
        return None
    if finished.reason is FinishReason.STOP_TOKEN:
        return int(finished.matched_stop)
    return finished.matched_stop


def vllm_prompt_logprobs(prompt_token_ids: list[int], entries: tuple | None, token_text: Callable[[int], str],
                         top: int) -> list:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token a dict by token id of its logprob,
    rank and text, and of each top alternative's (`entries` None: a one-token prompt, nothing scored)."""
    out: list = [None]
    for token, (logprob, rank, alternatives) in zip(prompt_token_ids[1:], entries or ()):
        position = {str(t): {"logprob": v, "rank": i + 1, "decoded_token": token_text(t)}
                    for i, (t, v) in enumerate(alternatives[:top])}
        position[str(token)] = {"logprob": logprob, "rank": rank, "decoded_token": token_text(token)}
        out.append(position)
    return out + [None] * (len(prompt_token_ids) - len(out))  # none came (a simulated worker)


def usage(finished: Finished) -> dict:
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": finished.completion_tokens,
        "total_tokens": finished.total_tokens,
    }


def error_body(error: ApiError) -> dict:
    """OpenAI's error body, with BladeLLM's `error_info` beside it (docs/compatibility.md)."""
    return {"error": {"message": error.message, "type": error.error_type, "param": error.param, "code": error.status},
            "error_info": {"code": error.status, "message": error.message}}


class OpenAIFormatter(SseFormatter):
    """What chat and completion formatters share: the response's identity and output options."""

    done_marker = "[DONE]"

    def __init__(self, request_id: str, created: int, model: str, full_text: bool, return_token_ids: bool,
                 prompt_token_ids: list[int], token_text: Callable[[int], str] = str,
                 stream_options: StreamOptions | None = None):
        self.request_id = request_id
        self.created = created
        self.model = model
        self.full_text = full_text
        self.return_token_ids = return_token_ids
        self.prompt_token_ids = prompt_token_ids
        self.token_text = token_text  # token id -> its text, for logprobs
        self.show_logprobs = True  # False when logprobs were only asked for to rank best_of
        self.show_prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs`: alternatives shown per position
        self.include_usage = bool(stream_options and stream_options.include_usage)
        self.continuous_usage = bool(stream_options and stream_options.continuous_usage_stats)
        self._plain_options = not (full_text or return_token_ids or self.continuous_usage)

    chunk_object = "chat.completion.chunk"
    _template: ChunkTemplate | None = None

    def plain_chunk(self, delta: TokenDelta) -> bool:
        """Whether a token's chunk has the common shape: its text is all that varies from token to token."""
        return self._plain_options and (delta.logprob is None or not self.show_logprobs) \
            and (delta.index or self.show_prompt_logprobs is None)

    def templated(self, text: str, make_frame: Callable[[str], dict]) -> bytes:
        """The chunk `make_frame(text)` encodes to, from a template made on first use."""
        if self._template is None:
            self._template = ChunkTemplate(make_frame(ChunkTemplate.SLOT))
        return self._template.fill(text)

    def running_usage(self, delta: TokenDelta) -> dict:
        """Usage so far, for `continuous_usage_stats` (the chat chunk page, docs/compatibility.md: on every chunk)."""
        prompt = len(self.prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": delta.index + 1,
                "total_tokens": prompt + delta.index + 1}

    def usage_chunks(self, finished: Finished) -> list[dict]:
        """With `include_usage`, OpenAI's last chunk: no choices, only usage."""
        if not self.include_usage:
            return []
        return [{"id": self.request_id, "object": self.chunk_object, "created": self.created, "model": self.model,
                 "choices": [], "usage": usage(finished), "error_info": None}]


async def serve_openai(request: web.Request, body: OpenAIRequest, gen: GenerationRequest,
                       make_formatter: Callable[[], OpenAIFormatter]) -> web.StreamResponse:
    """Serve `body.num_generations` copies of `gen` and answer with the best `body.n` as choices."""
    return await serve_openai_batch(request, body, [gen], lambda _: make_formatter())


async def serve_openai_batch(request: web.Request, body: OpenAIRequest, gens: list[GenerationRequest],
                             make_formatter: Callable[[int], OpenAIFormatter]) -> web.StreamResponse:
    """Serve `body.num_generations` copies of each prompt's `gens[g]` (formatted by `make_formatter(g)`) and
    answer with the best `body.n` of each as choices g * n .. g * n + n - 1."""
    groups = [fan_out(gen, body.num_generations) for gen in gens]
    formatters = [[make_formatter(g) for _ in group] for g, group in enumerate(groups)]
    for formatter in (f for group in formatters for f in group):
        formatter.show_logprobs = body.logprobs_count() is not None
    return await serve_choices(request, request.app[STATE].pipeline, groups, formatters, body.n, body.stream)
