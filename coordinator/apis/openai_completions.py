"""POST /v1/completions: OpenAI (vLLM flavour) text completions, stream and non-stream."""

from __future__ import annotations

from typing import Annotated

from aiohttp import web
from pydantic import AfterValidator, model_validator

from coordinator.apis.fields import new_id, read_request
from coordinator.apis.guided import checked_grammar
from coordinator.apis.openai_common import (
    OpenAIFormatter,
    vllm_prompt_logprobs,
    OpenAIRequest,
    error_body,
    finish_reason,
    serve_openai_batch,
    stop_reason,
    usage,
)
from coordinator.apis.prompts import CompletionPrompt, prompt_batch, tokenize_batch
from coordinator.apis.response_models import Completion, Reply
from coordinator.http.route_table import ErrorStyle, Route
from coordinator.errors import ApiError
from coordinator.requests.request import Finished, GenerationRequest, TokenDelta
from coordinator.requests.serving import Transcript
from coordinator.state import STATE


# Every prompt of a batch gets best_of (or n) generations; their total is bounded, as n and best_of are.
MAX_BATCH_GENERATIONS = 2048


def _logprobs(v: int | None) -> int | None:
    if v is not None and not 0 <= v <= 5:
        raise ValueError(f"must be in [0, 5], got {v}")
    return v


class CompletionRequest(OpenAIRequest):
    """The body of a completion request."""

    prompt: CompletionPrompt
    logprobs: Annotated[int | None, AfterValidator(_logprobs)] = None

    @model_validator(mode="after")
    def _batch_within_limit(self):
        num_prompts = len(prompt_batch(self.prompt))
        if num_prompts * self.num_generations > MAX_BATCH_GENERATIONS:
            raise ValueError(f"prompt: {num_prompts} prompts x {self.num_generations} generations each is more than "
                             f"{MAX_BATCH_GENERATIONS} generations in one request")
        return self

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_count(self) -> int | None:
        # echo with logprobs scores the echoed prompt too, as OpenAI's legacy completions do.
        asked = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None]
        return max(asked) if asked else None


class CompletionFormatter(OpenAIFormatter):
    """`text_completion` objects, one per token when streaming, usage on the last."""

    chunk_object = "text_completion"

    def _body(self, choice: dict, **extra) -> dict:
        return {"id": self.request_id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [choice], **extra}

    def _choice(self, text: str, finished: Finished | None, logprobs: dict | None = None) -> dict:
        return {"index": 0, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason(finished) if finished else None,
                "stop_reason": stop_reason(finished)}

    echo_logprobs: int | None = None  # echo with logprobs: the echoed prompt's tokens lead them, this many alternatives

    def _logprobs(self, deltas: list[TokenDelta], offset: int) -> dict | None:
        """vLLM's completion logprobs: tokens, their logprobs, the top alternatives, text offsets (with
        `echo_logprobs`, the prompt's tokens first, the first one's logprob None)."""
        if not deltas or deltas[0].logprob is None or not self.show_logprobs:
            return None
        block = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        if self.echo_logprobs is not None and deltas[0].index == 0:
            scored = ((None, ()),) + tuple((lp, top[: self.echo_logprobs])
                                           for lp, _, top in deltas[0].prompt_logprobs or ())
            scored += ((None, ()),) * (len(self.prompt_token_ids) - len(scored))  # none came (a simulated worker)
            prompt_offset = 0
            for token, (logprob, top) in zip(self.prompt_token_ids, scored):
                text = self.token_text(token)
                block["text_offset"].append(prompt_offset)
                block["tokens"].append(text)
                block["token_logprobs"].append(logprob)
                block["top_logprobs"].append({self.token_text(t): lp for t, lp in top} if logprob is not None else None)
                prompt_offset += len(text)
        for d in deltas:
            block["text_offset"].append(offset)
            block["tokens"].append(self.token_text(d.token_id))
            block["token_logprobs"].append(d.logprob)
            block["top_logprobs"].append({self.token_text(t): lp for t, lp in d.top_logprobs})
            offset += len(d.text)
        return block

    echo_text = ""  # the prompt, when the request asked for echo

    def token_bytes(self, delta: TokenDelta, transcript: Transcript) -> bytes | None:
        if not self.plain_chunk(delta) or (self.echo_text and delta.index == 0):
            return None
        return self.templated(delta.text, lambda text: self._body(self._choice(text, None)))

    def token_frames(self, delta: TokenDelta, transcript: Transcript) -> list[dict]:
        offset = transcript.length - len(delta.text) + len(self.echo_text)
        logprobs = self._logprobs([delta], offset) if delta.logprob is not None else None
        text = transcript.text if self.full_text else delta.text
        if self.full_text or delta.index == 0:
            text = self.echo_text + text
        choice = self._choice(text, None, logprobs)
        if delta.index == 0 and self.show_prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(self.prompt_token_ids, delta.prompt_logprobs,
                                                             self.token_text, self.show_prompt_logprobs)
        if self.return_token_ids:
            choice["token_ids"] = [delta.token_id]
            if delta.index == 0:
                choice["prompt_token_ids"] = self.prompt_token_ids
        return [self._body(choice, **({"usage": self.running_usage(delta)} if self.continuous_usage else {}))]

    def final_frames(self, finished: Finished, transcript: Transcript) -> list[dict]:
        extra = {"full_text": self.echo_text + transcript.text} if self.full_text else {}
        text = self.echo_text + transcript.text if self.full_text else ""
        return [self._body(self._choice(text, finished), **extra, usage=usage(finished), error_info=None)] \
            + self.usage_chunks(finished)

    def error_frames(self, error: ApiError, transcript: Transcript) -> list[dict]:
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop", "stop_reason": None}
        return [self._body(choice, **error_body(error))]

    def response(self, transcript: Transcript) -> dict:
        finished = transcript.finished
        choice = self._choice(self.echo_text + transcript.text, finished,
                              self._logprobs(transcript.deltas, len(self.echo_text)))
        if self.show_prompt_logprobs is not None and transcript.deltas:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(self.prompt_token_ids, transcript.deltas[0].prompt_logprobs,
                                                             self.token_text, self.show_prompt_logprobs)
        if self.return_token_ids:
            choice["token_ids"] = transcript.token_ids
            choice["prompt_token_ids"] = self.prompt_token_ids
        return self._body(choice, usage=usage(finished), error_info=None)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_request(request, CompletionRequest, state.tokenizer.vocab_size)
    lora = state.loras.select(body.model, "model")
    prompts = await tokenize_batch(state, body.prompt, "prompt", with_text=body.echo)
    guided = await checked_grammar(state.grammars, body.constraint())
    sampling = body.sampling(guided)
    for p in prompts:
        state.limits.check_prompt_logprobs(len(p.token_ids), sampling.prompt_logprobs,
                                           "prompt_logprobs" if body.prompt_logprobs is not None else "logprobs")
    request_id = new_id("cmpl")
    gens = [GenerationRequest(request_id if len(prompts) == 1 else f"{request_id}-p{g}", p.token_ids, sampling,
                              body.max_tokens, media=p.media, lora=lora) for g, p in enumerate(prompts)]

    def formatter(g: int) -> CompletionFormatter:
        f = CompletionFormatter(request_id, gens[0].created, lora.name if lora else state.model_name, state.full_text,
                                body.return_token_ids,
                                prompts[g].token_ids, state.tokenizer.token_text, body.stream_options)
        f.echo_text = prompts[g].text if body.echo else ""
        f.echo_logprobs = body.logprobs if body.echo else None
        f.show_prompt_logprobs = body.prompt_logprobs
        return f

    return await serve_openai_batch(request, body, gens, formatter)


ROUTES = [Route("POST", "/v1/completions", completions, ErrorStyle.OPENAI, "openai_completions", generation=True,
                body_model=CompletionRequest, reply=Reply(json=Completion, events=Completion, done_marker="[DONE]"))]
