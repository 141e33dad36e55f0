"""TGI text generation: POST /generate_stream (the MindIE API, docs/compatibility.md), POST / for TGI clients, and
/generate's TGI half.

`POST /` is what `huggingface_hub.InferenceClient(base_url=...)` calls, with `stream` in the body;
it answers in real TGI's shapes (token `id` an int). `/generate_stream` follows the MindIE API, whose
stream token `id` is a one-element list.
"""

from __future__ import annotations

import dataclasses

from collections.abc import Callable
from typing import Annotated

from aiohttp import web
from pydantic import AfterValidator, BaseModel, ConfigDict, model_validator

from coordinator.apis.fields import PositiveInt32, PromptInput, new_id, parse_request, read_json, stop_tuple
from coordinator.apis.guided import TgiGrammar, checked_grammar
from coordinator.apis.prompts import tokenize_input
from coordinator.apis.response_models import Reply, TextGenErrorBody, TgiResponse, TgiStreamEvent
from coordinator.http.route_table import ErrorStyle, Route
from coordinator.apis.tgi_family import TextGenFormatter, TextGenParameters, finish_details
from coordinator.errors import ApiError
from coordinator.requests.request import Finished, SamplingOptions, TokenDelta
from coordinator.requests.serving import Transcript, serve_generation
from coordinator.state import STATE

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


class TgiParameters(TextGenParameters):
    """`parameters` of a TGI request, with the ranges of the MindIE API (docs/compatibility.md)."""

    decoder_input_details: bool = False
    return_full_text: bool = False
    truncate: PositiveInt32 | None = None
    stop: Annotated[str | list[str] | None, AfterValidator(_stop)] = None
    grammar: TgiGrammar | None = None

    def sampling(self, **extra) -> SamplingOptions:
        # logprobs=0: TGI reports each token's logprob; decoder_input_details each prompt token's too.
        return super().sampling(stop=stop_tuple(self.stop), logprobs=0,
                                prompt_logprobs=0 if self.decoder_input_details else None, **extra)


class TgiRequest(BaseModel):
    """A TGI request body; `stream` is only read on `POST /`."""

    model_config = ConfigDict(extra="forbid")

    inputs: PromptInput
    parameters: TgiParameters = TgiParameters()
    stream: bool = False

    @model_validator(mode="after")
    def _stream_without_prefill_details(self):
        if self.stream and self.parameters.decoder_input_details:
            raise ValueError("decoder_input_details must be false when streaming")
        return self


class TgiFormatter(TextGenFormatter):
    """TGI responses; `list_ids` writes stream token ids as `[id]`, as the MindIE API (docs/compatibility.md) does."""

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

    def stream_event(self, delta: TokenDelta, transcript: Transcript, finished: Finished | None) -> dict:
        token = self._token(delta.token_id, self.streamed_text(delta, transcript), delta.logprob)
        if self.list_ids:
            token["id"] = [delta.token_id]
        event = {"token": token, "generated_text": None, "details": None}
        if finished is not None:
            event["generated_text"] = self._generated_text(transcript)
            if self.params.details:
                event["details"] = {"prompt_tokens": finished.prompt_tokens, **finish_details(finished),
                                    "seed": self.seed}
        return event

    def response(self, transcript: Transcript) -> dict | list:
        finished = transcript.finished
        body: dict = {"generated_text": self._generated_text(transcript)}
        if self.params.details or self.params.decoder_input_details:
            prefill = []
            if self.params.decoder_input_details:
                # The first token has no logprob (nothing comes before it), as in TGI.
                scored = (transcript.deltas[0].prompt_logprobs if transcript.deltas else None) or ()
                logprobs = [None] + [lp for lp, _, _ in scored]
                prefill = [self._token(t, self.token_text(t), logprobs[i] if i < len(logprobs) else None)
                           for i, t in enumerate(self.prompt_token_ids)]
            body["details"] = {
                **finish_details(finished),
                "prefill": prefill,
                "prompt_tokens": finished.prompt_tokens,
                "seed": self.seed,
                "tokens": [self._token(d.token_id, self.token_text(d.token_id), d.logprob) for d in transcript.deltas],
            }
        return [body] if self.wrap_in_list else body


async def serve_tgi(request: web.Request, body, stream: bool, native_shapes: bool) -> web.StreamResponse:
    """Serve a TGI body; `native_shapes` answers as real TGI does, else as the MindIE API (docs/compatibility.md)
    does."""
    state = request.app[STATE]
    if isinstance(body, dict):
        body = {**body, "stream": stream}
    req = parse_request(TgiRequest, body)
    params = req.parameters
    prompt = await tokenize_input(state, req.inputs, "inputs", keep_last=params.truncate)
    guided = await checked_grammar(state.grammars, params.grammar.constraint() if params.grammar else None)
    lora = state.loras.select(params.adapter_id, "parameters.adapter_id")
    gen = params.generation(new_id("tgi"), prompt.token_ids, guided=guided, media=prompt.media, lora=lora)
    if state.engine == "vllm":  # its prefill instances do not hand prompt logprobs over: `prefill` logprobs are null
        gen.sampling = dataclasses.replace(gen.sampling, prompt_logprobs=None)
    state.limits.check_prompt_logprobs(len(prompt.token_ids), gen.sampling.prompt_logprobs,
                                       "parameters.decoder_input_details")
    formatter = TgiFormatter(req, prompt.text, prompt.token_ids, gen.sampling.seed, state.full_text,
                             state.tokenizer.token_text, state.tokenizer.special_ids,
                             list_ids=not native_shapes, wrap_in_list=native_shapes)
    return await serve_generation(request, state.pipeline, gen, formatter, stream)


def _stream_flag(body) -> bool | None:
    """The body's `stream`, which must be a boolean when present (it is read before the body is validated)."""
    stream = body.get("stream") if isinstance(body, dict) else None
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, f"stream: must be a boolean, got {type(stream).__name__}", param="stream")
    return stream


async def generate_stream(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    if _stream_flag(body) is False:
        raise ApiError(400, "stream: /generate_stream always streams; omit stream or send true", param="stream")
    return await serve_tgi(request, body, stream=True, native_shapes=False)


async def tgi_compat(request: web.Request) -> web.StreamResponse:
    """POST /: what TGI clients (huggingface_hub.InferenceClient) call; `stream` picks the mode."""
    body = await read_json(request)
    return await serve_tgi(request, body, stream=bool(_stream_flag(body)), native_shapes=True)


ROUTES = [
    Route("POST", "/generate_stream", generate_stream, ErrorStyle.TGI, "tgi", generation=True, body_model=TgiRequest,
          reply=Reply(events=TgiStreamEvent | TextGenErrorBody)),
    Route("POST", "/", tgi_compat, ErrorStyle.TGI, "tgi", generation=True, body_model=TgiRequest,
          reply=Reply(json=list[TgiResponse], events=TgiStreamEvent | TextGenErrorBody)),
]
