"""vLLM's native POST /generate (a body with `prompt`): `{"text": [...]}`; streams end each object with NUL."""

from __future__ import annotations

import json

from aiohttp import web
from pydantic import ConfigDict

from coordinator.apis.fields import PromptInput, VllmSamplingFields, new_id, parse_request
from coordinator.apis.prompts import tokenize_input
from coordinator.apis.tgi_family import error_frame
from coordinator.errors import ApiError
from coordinator.requests.request import Finished, GenerationRequest, TokenDelta
from coordinator.requests.serving import Transcript, serve_generation
from coordinator.state import STATE


class VllmGenerateRequest(VllmSamplingFields):
    """The body of vLLM's /generate, with the ranges of the MindIE API (docs/compatibility.md)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    prompt: PromptInput
    stream: bool = False
    model: str | None = None  # the LoRA adapter's name (the MindIE API's LoRA id); None, "None" or the model: the base


class VllmFormatter:
    """One `{"text": [...]}` object per token, each followed by a NUL byte, as vLLM streams."""

    done_marker = None
    # NUL-separated JSON objects are not one JSON document; vLLM's own server names no type at all.
    stream_content_type = "application/octet-stream"

    def __init__(self, prompt: str, full_text: bool):
        self.prompt = prompt
        self.full_text = full_text

    def encode(self, frame: dict | str) -> bytes:
        return json.dumps(frame, ensure_ascii=False).encode("utf-8") + b"\0"

    def token_bytes(self, delta: TokenDelta, transcript: Transcript) -> None:
        return None

    def token_frames(self, delta: TokenDelta, transcript: Transcript) -> list[dict]:
        return [{"text": [transcript.text if self.full_text else delta.text]}]

    def final_frames(self, finished: Finished, transcript: Transcript) -> list[dict]:
        return []

    def error_frames(self, error: ApiError, transcript: Transcript) -> list[dict]:
        return [error_frame(error)]

    def response(self, transcript: Transcript) -> dict:
        # As the example of the MindIE API (docs/compatibility.md) shows, the answer repeats the prompt before the
        # generated text.
        return {"text": [self.prompt + transcript.text]}


async def serve_vllm(request: web.Request, body: dict) -> web.StreamResponse:
    """Serve a vLLM /generate body (POST /generate routes here when the body has `prompt`)."""
    state = request.app[STATE]
    req = parse_request(VllmGenerateRequest, body, state.tokenizer.vocab_size)
    lora = state.loras.select(req.model, "model")
    prompt = await tokenize_input(state, req.prompt, "prompt")
    gen = GenerationRequest(new_id("vllm"), prompt.token_ids, req.sampling(), req.max_tokens, media=prompt.media,
                            lora=lora)
    return await serve_generation(request, state.pipeline, gen, VllmFormatter(prompt.text, state.full_text),
                                  req.stream)
