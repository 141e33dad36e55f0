"""POST /v1/completions: OpenAI (vLLM flavour) text completions, stream and non-stream."""

from __future__ import annotations

from coordinator.apis.openai_common import OpenAIFormatter, OpenAIRequest, error_body, finish_reason, new_id, usage
from coordinator.errors import ApiError
from coordinator.request import Finished, TokenDelta
from coordinator.serving import Transcript


class CompletionRequest(OpenAIRequest):
    """The body of a completion request."""

    prompt: str


class CompletionFormatter(OpenAIFormatter):
    """`text_completion` objects, one per token when streaming, usage on the last."""

    def _body(self, choice: dict, **extra) -> dict:
        return {"id": self.request_id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [choice], **extra}

    def _choice(self, text: str, finished: Finished | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None,
                "finish_reason": finish_reason(finished) if finished else None,
                "stop_reason": finished.matched_stop if finished else None}

    def token_frames(self, delta: TokenDelta, transcript: Transcript) -> list[dict]:
        choice = self._choice(transcript.text if self.full_text else delta.text, None)
        if self.return_token_ids:
            choice["token_ids"] = [delta.token_id]
            if delta.index == 0:
                choice["prompt_token_ids"] = self.prompt_token_ids
        return [self._body(choice)]

    def final_frames(self, finished: Finished, transcript: Transcript) -> list[dict]:
        extra = {"full_text": transcript.text} if self.full_text else {}
        text = transcript.text if self.full_text else ""
        return [self._body(self._choice(text, finished), **extra, usage=usage(finished))]

    def error_frames(self, error: ApiError, transcript: Transcript) -> list[dict]:
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop", "stop_reason": None}
        return [self._body(choice, **error_body(error))]

    def response(self, transcript: Transcript) -> dict:
        finished = transcript.finished
        choice = self._choice(transcript.text, finished)
        if self.return_token_ids:
            choice["token_ids"] = transcript.token_ids
            choice["prompt_token_ids"] = self.prompt_token_ids
        return self._body(choice, usage=usage(finished))


def new_request_id() -> str:
    return new_id("cmpl")
