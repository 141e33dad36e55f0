"""POST /v1/chat/completions: OpenAI chat, stream and non-stream, in the chunk format of the chat streaming page
(docs/compatibility.md)."""

from __future__ import annotations

import json
from typing import Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from coordinator.apis.multimodal import MAX_MEDIA_ITEMS, MediaRef
from coordinator.apis.prompts import items_prompt, with_media
from coordinator.apis.chat_output import ChatOutputParser, ChatPiece, split_whole
from coordinator.apis.fields import MaxTokens, new_id, read_request
from coordinator.apis.guided import checked_grammar, tool_call_lark
from coordinator.apis.openai_common import (
    OpenAIFormatter,
    OpenAIRequest,
    error_body,
    finish_reason,
    serve_openai,
    usage,
    vllm_prompt_logprobs,
)
from coordinator.apis.response_models import ChatCompletion, ChatCompletionChunk, Reply
from coordinator.http.route_table import ErrorStyle, Route
from coordinator.errors import ApiError
from coordinator.requests.request import Finished, GenerationRequest, TokenDelta
from coordinator.requests.serving import Transcript
from coordinator.state import STATE


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    """A tool the model may call (OpenAI `tools[]`)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class ToolName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the function the model must call."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: ToolName


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str | dict = "{}"  # OpenAI sends JSON text; an object is accepted and written as JSON


class PastToolCall(BaseModel):
    """A call an earlier assistant turn made (OpenAI `messages[].tool_calls[]`)."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict:
        args = self.function.arguments
        function = {"name": self.function.name, "arguments": args if isinstance(args, str) else json.dumps(args)}
        return {**({"id": self.id} if self.id else {}), "type": self.type, "function": function}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    # A string, or a list of typed parts ({"type": "text", ...}; media parts follow the multimodal rules).
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[PastToolCall] | None = None  # an earlier assistant turn's calls
    tool_call_id: str | None = None  # a tool message answers this call

    @model_validator(mode="after")
    def _content_rules(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only for an assistant message with tool_calls)")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")

    def has_content(self) -> bool:
        """Text, or a part of another kind (an image alone is a question)."""
        return bool(self.text()) or isinstance(self.content, list) and any(
            isinstance(p, dict) and p.get("type") != "text" for p in self.content)


class ChatCompletionRequest(OpenAIRequest):
    """The body of a chat completion request."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolSpec] | None = None
    tool_choice: NamedToolChoice | str | None = None
    # BladeLLM (docs/compatibility.md): the start of an interrupted assistant reply; the output continues it (and
    # holds only the rest).
    resume_response: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _tool_choice_rules(self):
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools")
        return self

    def extra_constraints(self) -> list[tuple[str, str, object]]:
        """A forced call ("required", or a named function) is a grammar over the tools' calls."""
        choice = self.tool_choice
        if choice is None or choice in ("auto", "none") or not self.tools:
            return []
        tools = {t.function.name: t.function.parameters for t in self.tools}
        if choice == "required":
            return [("tool_choice", "grammar", tool_call_lark(tools, repeat=True))]
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in tools:
                raise ValueError(f"tool_choice names {choice.function.name!r}, which is not one of the tools "
                                 f"({', '.join(tools)})")
            name = choice.function.name
            return [("tool_choice", "grammar", tool_call_lark({name: tools[name]}, repeat=False))]
        raise ValueError(f"tool_choice={choice!r}: expected \"none\", \"auto\", \"required\" or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}")

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @model_validator(mode="after")
    def _resume_follows_a_prompt(self):
        if self.resume_response is not None and self.messages[-1].role == "assistant":
            # Else it is unclear whether that message is an earlier finished turn or the reply's start.
            raise ValueError("resume_response continues the reply to the last message, which must not be an "
                             "assistant message; send the partial reply only in resume_response")
        return self

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
        if not any(m.has_content() for m in messages):
            raise ValueError("at least one message must have non-empty content")
        return messages

    def template_messages(self, content_text=None) -> list[dict]:
        """Messages for the chat template; `content_text(parts, param)` turns a part list into text."""
        out = []
        for i, m in enumerate(self.messages):
            text = m.text() if not isinstance(m.content, list) or content_text is None \
                else content_text(m.content, f"messages.{i}.content")
            message = {"role": m.role, "content": text}
            if m.tool_calls:
                message["tool_calls"] = [call.for_template() for call in m.tool_calls]
            if m.tool_call_id:
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        return out

    def template_tools(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class ChatFormatter(OpenAIFormatter):
    """Chunks as in the chat streaming page (docs/compatibility.md): delta{role, content} per token, a final chunk with
    usage."""

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, deltas: list[TokenDelta]) -> dict | None:
        """OpenAI chat logprobs: per token, its logprob and the top alternatives."""
        if not deltas or deltas[0].logprob is None or not self.show_logprobs:
            return None
        return {"content": [{**self._entry(d.token_id, d.logprob),
                             "top_logprobs": [self._entry(t, lp) for t, lp in d.top_logprobs]} for d in deltas]}

    def __init__(self, *args, parse_tools: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.parse_tools = parse_tools
        self._parser: ChatOutputParser | None = None  # made on first use, once parse_tools is final
        self._released = Transcript()  # content released so far (fullTextEnabled streams it whole)

    def _piece(self, text: str, final: bool = False) -> ChatPiece:
        if self._parser is None:
            self._parser = ChatOutputParser(self.parse_tools)
        piece = self._parser.feed(text, final)
        if self.full_text:
            self._released.pieces.append(piece.content)
        return piece

    def _chunk(self, content: str, finish: str | None, logprobs: dict | None = None, reasoning: str = "",
               **extra) -> dict:
        delta = {"role": "assistant", "content": content}
        if reasoning:
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        if "tool_calls" in extra:
            delta["tool_calls"] = extra.pop("tool_calls")
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if "token_ids" in extra:
            choice["token_ids"] = extra.pop("token_ids")
        if "prompt_logprobs" in extra:
            choice["prompt_logprobs"] = extra.pop("prompt_logprobs")
        return {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, **extra, "choices": [choice]}

    echo_text = ""  # the prompt as the template rendered it, when the request asked for echo

    def token_bytes(self, delta: TokenDelta, transcript: Transcript) -> bytes | None:
        if not self.plain_chunk(delta) or (self.echo_text and delta.index == 0):
            return None
        piece = self._piece(delta.text)
        if piece.reasoning:
            return self.encode(self._chunk(piece.content, None, None, piece.reasoning))
        return self.templated(piece.content, lambda text: self._chunk(text, None))

    def token_frames(self, delta: TokenDelta, transcript: Transcript) -> list[dict]:
        extra = {"token_ids": [delta.token_id]} if self.return_token_ids else {}
        if self.return_token_ids and delta.index == 0:
            extra["prompt_token_ids"] = self.prompt_token_ids
        if self.continuous_usage:
            extra["usage"] = self.running_usage(delta)
        if delta.index == 0 and self.show_prompt_logprobs is not None:
            extra["prompt_logprobs"] = vllm_prompt_logprobs(self.prompt_token_ids, delta.prompt_logprobs,
                                                            self.token_text, self.show_prompt_logprobs)
        piece = self._piece(delta.text)
        content = self._released.text if self.full_text else piece.content
        if delta.index == 0 or self.full_text:
            content = self.echo_text + content
        return [self._chunk(content, None, self._logprobs([delta]), piece.reasoning, **extra)]

    def final_frames(self, finished: Finished, transcript: Transcript) -> list[dict]:
        piece = self._piece("", final=True)
        calls, invalid = self._parser.tool_calls()
        self._released.pieces.append(invalid)
        extra = {"full_text": transcript.text} if self.full_text else {}
        reason = finish_reason(finished)
        if calls:
            extra["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
            reason = "tool_calls"
        content = self._released.text if self.full_text else piece.content + invalid
        return [self._chunk(content, reason, None, piece.reasoning, **extra, usage=usage(finished), error_info=None)] \
            + self.usage_chunks(finished)

    def error_frames(self, error: ApiError, transcript: Transcript) -> list[dict]:
        return [self._chunk("", "stop", **error_body(error))]

    def response(self, transcript: Transcript) -> dict:
        finished = transcript.finished
        content, reasoning, calls = split_whole(transcript.text, self.parse_tools)
        content = self.echo_text + content if self.echo_text else content
        message = {"role": "assistant", "content": content if content or not calls else None}
        if reasoning:
            message["reasoning_content"] = message["reasoning"] = reasoning
        if calls:
            message["tool_calls"] = calls
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(transcript.deltas),
                  "finish_reason": "tool_calls" if calls else finish_reason(finished)}
        if self.return_token_ids:
            choice["token_ids"] = transcript.token_ids
        if self.show_prompt_logprobs is not None and transcript.deltas:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(self.prompt_token_ids, transcript.deltas[0].prompt_logprobs,
                                                             self.token_text, self.show_prompt_logprobs)
        body = {"id": self.request_id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage(finished), "prefill_time": round(finished.prefill_time_ms, 3),
                "decode_time_arr": [round(t, 3) for t in finished.decode_time_ms], "error_info": None}
        if self.return_token_ids:
            body["prompt_token_ids"] = self.prompt_token_ids
        return body


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_request(request, ChatCompletionRequest, state.tokenizer.vocab_size)
    lora = state.loras.select(body.model, "model")
    refs: list[MediaRef] = []
    texts: list[str] = []

    def content(parts: list, param: str) -> str | list[dict]:
        # A message with images keeps its parts, so the template places each image's placeholder.
        prompt = items_prompt(state, parts, param, require_text=False)
        if not prompt.media:
            return prompt.text
        refs.extend(prompt.media)
        texts.append(prompt.text)
        return list(prompt.parts)

    messages = body.template_messages(content)
    if len(refs) > MAX_MEDIA_ITEMS:
        raise ApiError(400, f"messages: at most {MAX_MEDIA_ITEMS} image/video/audio items in all, got {len(refs)}",
                       param="messages")
    state.limits.check_text("".join(m["content"] for m in messages if isinstance(m["content"], str)) + "".join(texts),
                            "messages")
    if body.resume_response is not None:
        state.limits.check_text(body.resume_response, "resume_response")
    prompt_ids = await state.tokenizer.encode_chat(messages, body.template_tools(), body.resume_response)
    prompt_ids, media = await with_media(state, prompt_ids, tuple(refs), "messages")
    state.limits.check_prompt(len(prompt_ids), "messages")
    # A resumed reply is already part of the constrained output: the grammar replays its tokens first.
    replay = state.tokenizer.continuation_ids(body.resume_response) if body.resume_response else ()
    guided = await checked_grammar(state.grammars, body.constraint(), replay, "resume_response")
    gen = GenerationRequest(new_id("chatcmpl"), prompt_ids, body.sampling(guided), body.max_tokens, media=media,
                            lora=lora)
    state.limits.check_prompt_logprobs(len(prompt_ids), gen.sampling.prompt_logprobs, "prompt_logprobs")

    # echo: the prompt as the chat template rendered it, before the reply (BladeLLM's "the prompt with the result").
    echo_text = state.tokenizer.tokenizer.decode(prompt_ids) if body.echo else ""

    def formatter() -> ChatFormatter:
        f = ChatFormatter(gen.request_id, gen.created, lora.name if lora else state.model_name, state.full_text,
                          body.return_token_ids, prompt_ids, state.tokenizer.token_text, body.stream_options,
                          parse_tools=body.parse_tools)
        f.echo_text = echo_text
        f.show_prompt_logprobs = body.prompt_logprobs
        return f

    return await serve_openai(request, body, gen, formatter)


ROUTES = [Route("POST", "/v1/chat/completions", chat_completions, ErrorStyle.OPENAI, "openai_chat", generation=True,
                body_model=ChatCompletionRequest,
                reply=Reply(json=ChatCompletion, events=ChatCompletionChunk, done_marker="[DONE]"))]
