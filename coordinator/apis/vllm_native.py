"""vLLM's native POST /generate (a body with `prompt`): `{"text": [...]}`; streams end each object with NUL."""

from __future__ import annotations

import json

from pydantic import ConfigDict, Field

from coordinator.apis.fields import VllmSamplingFields
from coordinator.errors import ApiError
from coordinator.request import Finished, TokenDelta
from coordinator.serving import Transcript


class VllmGenerateRequest(VllmSamplingFields):
    """The body of vLLM's /generate, with the seed's ranges."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    prompt: str | list = Field(min_length=1)
    stream: bool = False
    model: str | None = None  # a LoRA id in the seed; only the served model (or "None") is accepted


def check_lora(model: str | None, served: str) -> None:
    if model not in (None, "None", served):
        raise ApiError(400, f"model={model!r}: LoRA adapters are not supported; send \"None\" or {served!r}",
                       param="model")


class VllmFormatter:
    """One `{"text": [...]}` object per token, each followed by a NUL byte, as vLLM streams."""

    done_marker = None
    stream_content_type = "application/json"

    def __init__(self, prompt: str, full_text: bool):
        self.prompt = prompt
        self.full_text = full_text

    def encode(self, frame: dict | str) -> bytes:
        return json.dumps(frame, ensure_ascii=False).encode("utf-8") + b"\0"

    def token_frames(self, delta: TokenDelta, transcript: Transcript) -> list[dict]:
        return [{"text": [transcript.text if self.full_text else delta.text]}]

    def final_frames(self, finished: Finished, transcript: Transcript) -> list[dict]:
        return []

    def error_frames(self, error: ApiError, transcript: Transcript) -> list[dict]:
        return [{"error": error.message, "error_type": error.error_type}]

    def response(self, transcript: Transcript) -> dict:
        # As the seed's example shows, the answer repeats the prompt before the generated text.
        return {"text": [self.prompt + transcript.text]}
