"""What OpenAI chat and completions share: field ranges, sampling mapping, usage, errors."""

from __future__ import annotations

import math
import secrets
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any

from aiohttp import web
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from coordinator.errors import ApiError
from coordinator.request import Finished, FinishReason, SamplingOptions

UINT32_MAX = 2147483647
UINT64_MAX = 18446744073709551615
STOP_TOTAL_CHARS = 32768


def _temperature(v: float) -> float:
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"must be a finite number >= 0.0, got {v}")
    return v


def _top_p(v: float) -> float:
    if not 1e-6 < v <= 1.0:
        raise ValueError(f"must be in (1e-6, 1.0], got {v}")
    return v


def _top_k(v: int) -> int:
    if v != -1 and not 0 < v <= UINT32_MAX:
        raise ValueError(f"must be -1 or in (0, {UINT32_MAX}], got {v}")
    return v


def _seed(v: int) -> int:
    if not 0 < v <= UINT64_MAX:
        raise ValueError(f"must be in (0, {UINT64_MAX}], got {v}")
    return v


def _max_tokens(v: int) -> int:
    if not 0 < v <= UINT32_MAX:
        raise ValueError(f"must be in (0, {UINT32_MAX}], got {v}")
    return v


def _stop(v: str | list[str] | None) -> str | list[str] | None:
    if v is None:
        return None
    if isinstance(v, str):
        if not 1 <= len(v) <= STOP_TOTAL_CHARS:
            raise ValueError(f"a stop string must have 1 to {STOP_TOTAL_CHARS} characters, got {len(v)}")
        return v
    if any(len(s) < 1 for s in v):
        raise ValueError("every stop string must have at least 1 character")
    if sum(len(s) for s in v) > STOP_TOTAL_CHARS:
        raise ValueError(f"stop strings may have at most {STOP_TOTAL_CHARS} characters in total")
    return v


def _repetition_penalty(v: float) -> float:
    if not 0.0 < v <= 2.0:
        raise ValueError(f"must be in (0.0, 2.0], got {v}")
    return v


def _penalty(v: float) -> float:
    if not -2.0 <= v <= 2.0:
        raise ValueError(f"must be in [-2.0, 2.0], got {v}")
    return v


def _token_ids(v: list[int] | None) -> list[int] | None:
    bad = [t for t in v or () if not 0 <= t <= UINT32_MAX]
    if bad:
        raise ValueError(f"token ids must be in [0, {UINT32_MAX}], got {bad[0]}")
    return v


def _min_tokens(v: int) -> int:
    if not 0 <= v <= UINT32_MAX:
        raise ValueError(f"must be in [0, {UINT32_MAX}], got {v}")
    return v


Temperature = Annotated[float, AfterValidator(_temperature)]
RepetitionPenalty = Annotated[float, AfterValidator(_repetition_penalty)]
Penalty = Annotated[float, AfterValidator(_penalty)]
TokenIds = Annotated[list[int] | None, AfterValidator(_token_ids)]
MinTokens = Annotated[int, AfterValidator(_min_tokens)]
TopP = Annotated[float, AfterValidator(_top_p)]
TopK = Annotated[int, AfterValidator(_top_k)]
Seed = Annotated[int, AfterValidator(_seed)]
MaxTokens = Annotated[int, AfterValidator(_max_tokens)]
Stop = Annotated[str | list[str] | None, AfterValidator(_stop)]

# Fields real clients send that later work will honour; until then a non-default value is a
# clear 400, never silently ignored. Values listed are the defaults that change nothing.
NOT_YET_SUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (1, None),
    "best_of": (1, None),
    "echo": (False, None),
    "logit_bias": (None, {}),
    "stream_options": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "suffix": (None,),
}


class OpenAIRequest(BaseModel):
    """Fields common to chat and completions, each validated against the seed's range."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    stream: bool = False
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    seed: Seed | None = None
    stop: Stop = None
    skip_special_tokens: bool = True
    repetition_penalty: RepetitionPenalty = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    stop_token_ids: TokenIds = None
    ignore_eos: bool = False
    min_tokens: MinTokens = 0
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    user: str | None = None  # end-user id for the operator's logs; does not affect generation

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, defaults in NOT_YET_SUPPORTED.items():
            if name in data:
                value = data[name]
                if not any(value == d and type(value) is type(d) for d in defaults):
                    raise ValueError(f"{name} is not supported by this server yet")
        return {k: v for k, v in data.items() if k not in NOT_YET_SUPPORTED}

    @model_validator(mode="after")
    def _min_tokens_within_max_tokens(self):
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}")
        return self

    def logprobs_count(self) -> int | None:
        """How many alternatives per token the client asked for; None for no logprobs."""
        return None

    def sampling(self) -> SamplingOptions:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingOptions(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=0 if self.top_k == -1 else self.top_k,
            # Generated here when absent, so the prefill and decode workers draw from one stream.
            seed=self.seed if self.seed is not None else secrets.randbits(63) + 1,
            stop=stop,
            skip_special_tokens=self.skip_special_tokens,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=self.logprobs_count(),
        )


def parse_request(model_cls: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body into `model_cls`, or raise a 400 naming the field and its range."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or None
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        raise ApiError(400, f"{field}: {msg}" if field else msg, param=field) from None


async def read_json(request: web.Request) -> Any:
    try:
        return await request.json()
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise ApiError(404, f"The model `{requested}` does not exist; this server serves `{served}`.", param="model")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def finish_reason(finished: Finished) -> str:
    return "length" if finished.reason is FinishReason.LENGTH else "stop"


def stop_reason(finished: Finished | None) -> str | int | None:
    """vLLM's `stop_reason`: the stop string, or the stop token id, that ended the output."""
    if finished is None or finished.matched_stop is None:
        return None
    if finished.reason is FinishReason.STOP_TOKEN:
        return int(finished.matched_stop)
    return finished.matched_stop


def usage(finished: Finished) -> dict:
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": finished.completion_tokens,
        "total_tokens": finished.total_tokens,
    }


def error_body(error: ApiError) -> dict:
    return {"error": {"message": error.message, "type": error.error_type, "param": error.param, "code": error.status}}


class OpenAIFormatter:
    """What chat and completion formatters share: the response's identity and output options."""

    done_marker = "[DONE]"

    def __init__(self, request_id: str, created: int, model: str, full_text: bool, return_token_ids: bool,
                 prompt_token_ids: list[int], token_text: Callable[[int], str] = str):
        self.request_id = request_id
        self.created = created
        self.model = model
        self.full_text = full_text
        self.return_token_ids = return_token_ids
        self.prompt_token_ids = prompt_token_ids
        self.token_text = token_text  # token id -> its text, for logprobs
