"""Field rules every client API shares: the ranges of the MindIE API's field tables (docs/compatibility.md), and
body parsing into 400s."""

from __future__ import annotations

import asyncio
import json
import math
import re
import secrets
from typing import Annotated, Any

import orjson
from aiohttp import web
from pydantic import AfterValidator, BaseModel, Field, ValidationError, ValidationInfo

from coordinator.errors import ApiError
from guidance.token_rules import LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS_ENTRIES
from coordinator.requests.request import SamplingOptions

# The MindIE API (docs/compatibility.md) types these fields "uint32_t" yet gives the range (0, 2147483647]: the
# int32 range.
INT32_MAX = 2147483647
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
    if v != -1 and not 0 < v <= INT32_MAX:
        raise ValueError(f"must be -1 or in (0, {INT32_MAX}], got {v}")
    return v


def _seed(v: int) -> int:
    if not 0 < v <= UINT64_MAX:
        raise ValueError(f"must be in (0, {UINT64_MAX}], got {v}")
    return v


def _max_tokens(v: int) -> int:
    if not 0 < v <= INT32_MAX:
        raise ValueError(f"must be in (0, {INT32_MAX}], got {v}")
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
    bad = [t for t in v or () if not 0 <= t <= INT32_MAX]
    if bad:
        raise ValueError(f"token ids must be in [0, {INT32_MAX}], got {bad[0]}")
    return v


def vocab_size(info: ValidationInfo | None) -> int | None:
    """The served model's vocabulary size, when the body is validated with it (`parse_request(..., vocab_size)`)."""
    return (info.context or {}).get("vocab_size") if info is not None else None


def check_in_vocab(token_ids, info: ValidationInfo | None) -> None:
    """Every id must name a row of the served model's logits (without a model: the int32 range)."""
    limit = vocab_size(info)
    for t in token_ids:
        if limit is not None and not 0 <= t < limit:
            raise ValueError(f"token id {t} is not in the vocabulary: ids must be in [0, {limit})")
        if not 0 <= t <= INT32_MAX:
            raise ValueError(f"token id {t} is out of range: ids must be in [0, {INT32_MAX}]")


def _logit_bias(v: dict[str, float] | None, info: ValidationInfo) -> dict[int, float] | None:
    """OpenAI's logit_bias: token ids (JSON object keys, so strings) to a bias in [-100, 100]."""
    biases: dict[int, float] = {}
    if v is not None and len(v) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} token ids may be biased, got {len(v)}")
    for key, bias in (v or {}).items():
        if not re.fullmatch(r"-?[0-9]+", key):
            raise ValueError(f"keys must be token ids written as integers, got {key!r}")
        token_id = int(key)
        check_in_vocab([token_id], info)
        if token_id in biases:
            raise ValueError(f"token id {token_id} is given twice")
        if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"token {token_id}: bias must be in [-100, 100], got {bias}")
        biases[token_id] = bias
    return biases or None


def _min_tokens(v: int) -> int:
    if not 0 <= v <= INT32_MAX:
        raise ValueError(f"must be in [0, {INT32_MAX}], got {v}")
    return v


Temperature = Annotated[float, AfterValidator(_temperature)]
RepetitionPenalty = Annotated[float, AfterValidator(_repetition_penalty)]
Penalty = Annotated[float, AfterValidator(_penalty)]
TokenIds = Annotated[list[int] | None, AfterValidator(_token_ids)]
LogitBias = Annotated[dict[str, float] | None, AfterValidator(_logit_bias)]
MinTokens = Annotated[int, AfterValidator(_min_tokens)]
TopP = Annotated[float, AfterValidator(_top_p)]
TopK = Annotated[int, AfterValidator(_top_k)]
Seed = Annotated[int, AfterValidator(_seed)]
MaxTokens = Annotated[int, AfterValidator(_max_tokens)]
Stop = Annotated[str | list[str] | None, AfterValidator(_stop)]
PositiveInt32 = MaxTokens  # (0, INT32_MAX]
PromptInput = Annotated[str | list, Field(min_length=1)]  # text, or a list of typed items (see multimodal)


def seed_fields(requested: int | None) -> dict:
    """SamplingOptions' seed: the client's, or a fresh one (marked drawn), so pdserve's prefill and decode workers
    draw from one stream; vLLM engines are sent only a client's (completions.py)."""
    if requested is not None:
        return {"seed": requested}
    return {"seed": secrets.randbits(63) + 1, "seed_drawn": True}


def stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


class VllmSamplingFields(BaseModel):
    """The sampling fields OpenAI completions/chat and vLLM's /generate share, with the ranges of the MindIE API
    (docs/compatibility.md)."""

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
    include_stop_str_in_output: bool = False
    logit_bias: LogitBias = None

    def sampling(self, **extra) -> SamplingOptions:
        return SamplingOptions(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=0 if self.top_k == -1 else self.top_k,
            **seed_fields(self.seed),
            stop=stop_tuple(self.stop),
            skip_special_tokens=self.skip_special_tokens,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=tuple(sorted((self.logit_bias or {}).items())),
            **extra,
        )


def parse_request(model_cls: type[BaseModel], body: Any, vocab_size: int | None = None) -> Any:
    """Validate a JSON body into `model_cls`, or raise a 400 naming the field and its range; with the served
    model's `vocab_size`, fields holding token ids are checked against it."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        return model_cls.model_validate(body, context={"vocab_size": vocab_size} if vocab_size else None)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or None
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        raise ApiError(400, f"{field}: {msg}" if field else msg, param=field) from None


async def read_request(request: web.Request, model_cls: type[BaseModel], vocab_size: int | None = None) -> Any:
    """The request's JSON body, validated into `model_cls` (token ids against `vocab_size` when given)."""
    return parse_request(model_cls, await read_json(request), vocab_size)


BODY_TIMEOUT = web.AppKey("body_timeout_s", float)
_LONG_DIGITS = re.compile(rb"[0-9]{19}")


async def read_json(request: web.Request) -> Any:
    """The request's body as JSON, or a 400 that says why it is not (a 408 when it trickles in too slowly)."""
    if request.content.is_eof():  # the whole body came with the head (the common case): nothing to wait for
        body = await request.read()
    else:
        timeout = request.config_dict.get(BODY_TIMEOUT, 30.0)
        try:
            # A client that trickles its body must not hold its request slot for long.
            async with asyncio.timeout(timeout):
                body = await request.read()
        except TimeoutError:
            raise ApiError(408, f"request body not received within http_config.body_timeout_s={timeout:g}s") from None
    if _LONG_DIGITS.search(body) is None:  # orjson reads an integer past 64 bits as a float; json keeps it exact
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass  # not necessarily invalid: json also takes UTF-16/32, a BOM, NaN and 1e400
    try:
        # From the bytes: json detects UTF-8/16/32 itself, where request.json() parses headers for a charset first.
        return json.loads(body)
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # the parser recurses per nesting level; a hostile body must not become a 500
        raise ApiError(400, "request body is not valid JSON: nested too deeply") from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(16)}"  # as random as uuid4().hex, without building a UUID

