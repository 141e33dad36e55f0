"""Field rules every client API shares: the seed tables' ranges, and body parsing into 400s."""

from __future__ import annotations

import math
import time
import uuid
from typing import Annotated, Any

from aiohttp import web
from pydantic import AfterValidator, BaseModel, ValidationError

from coordinator.errors import ApiError

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


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
