"""POST /v1/chat/completions: OpenAI chat, stream and non-stream, in the seed's chunk format."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from coordinator.apis.fields import MaxTokens
from coordinator.apis.openai_common import (
    OpenAIFormatter,
    OpenAIRequest,
    error_body,
    finish_reason,
    new_id,
    usage,
)
from coordinator.errors import ApiError
from coordinator.request import Finished, TokenDelta
from coordinator.serving import Transcript


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    # A string, or a list of typed parts ({"type": "text", ...}; media parts follow the multimodal rules).
    content: str | list[dict]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")


class ChatCompletionRequest(OpenAIRequest):
    """The body of a chat completion request."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _one_token_limit(self):
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError(f"max_tokens={self.max_tokens} and max_completion_tokens="
                                 f"{self.max_completion_tokens} disagree; send one of them")
            self.max_tokens = self.max_completion_tokens
        return self

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("messages")
    @classmethod
    def _not_blank(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not any(m.text() for m in messages):
            raise ValueError("at least one message must have non-empty content")
        return messages

    def template_messages(self, content_text=None) -> list[dict]:
        """Messages for the chat template; `content_text(parts, param)` turns a part list into text."""
        return [{"role": m.role, "content": m.text() if isinstance(m.content, str) or content_text is None
                 else content_text(m.content, f"messages.{i}.content")} for i, m in enumerate(self.messages)]


class ChatFormatter(OpenAIFormatter):
    """Chunks as in seed 000/003: delta{role, content} per token, a final chunk with usage."""

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, deltas: list[TokenDelta]) -> dict | None:
        """OpenAI chat logprobs: per token, its logprob and the top alternatives."""
        if not deltas or deltas[0].logprob is None:
            return None
        return {"content": [{**self._entry(d.token_id, d.logprob),
                             "top_logprobs": [self._entry(t, lp) for t, lp in d.top_logprobs]} for d in deltas]}

    def _chunk(self, content: str, finish: str | None, logprobs: dict | None = None, **extra) -> dict:
        choice = {"index": 0, "delta": {"role": "assistant", "content": content}, "logprobs": logprobs,
                  "finish_reason": finish}
        if "token_ids" in extra:
            choice["token_ids"] = extra.pop("token_ids")
        return {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, **extra, "choices": [choice]}

    def token_frames(self, delta: TokenDelta, transcript: Transcript) -> list[dict]:
        extra = {"token_ids": [delta.token_id]} if self.return_token_ids else {}
        if self.return_token_ids and delta.index == 0:
            extra["prompt_token_ids"] = self.prompt_token_ids
        if self.continuous_usage:
            extra["usage"] = self.running_usage(delta)
        return [self._chunk(transcript.text if self.full_text else delta.text, None, self._logprobs([delta]), **extra)]

    def final_frames(self, finished: Finished, transcript: Transcript) -> list[dict]:
        extra = {"full_text": transcript.text} if self.full_text else {}
        return [self._chunk(transcript.text if self.full_text else "", finish_reason(finished),
                            **extra, usage=usage(finished))] + self.usage_chunks(finished)

    def error_frames(self, error: ApiError, transcript: Transcript) -> list[dict]:
        return [self._chunk("", "stop", **error_body(error))]

    def response(self, transcript: Transcript) -> dict:
        finished = transcript.finished
        choice = {"index": 0, "message": {"role": "assistant", "content": transcript.text},
                  "logprobs": self._logprobs(transcript.deltas), "finish_reason": finish_reason(finished)}
        if self.return_token_ids:
            choice["token_ids"] = transcript.token_ids
        body = {"id": self.request_id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage(finished), "prefill_time": round(finished.prefill_time_ms, 3),
                "decode_time_arr": [round(t, 3) for t in finished.decode_time_ms]}
        if self.return_token_ids:
            body["prompt_token_ids"] = self.prompt_token_ids
        return body


def new_request_id() -> str:
    return new_id("chatcmpl")
