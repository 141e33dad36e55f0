"""Workloads to plan for: a JSONL trace of requests, or a seeded synthetic description of one."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MAX_TOKENS = 1_000_000  # one request's prompt or output, at most: past any model's context


class WorkloadError(ValueError):
    """A trace or a synthetic description that cannot be read; the message names the line or field."""


class TraceRequest(BaseModel):
    """One request of a workload: when it arrives (s from the start), its prompt and output lengths."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    arrival_s: float = Field(ge=0, allow_inf_nan=False, description="seconds after the workload starts")
    prompt_tokens: int = Field(ge=1, le=MAX_TOKENS)
    output_tokens: int = Field(ge=1, le=MAX_TOKENS, description="generated tokens, the first one included")


class Workload(BaseModel):
    """Requests in arrival order, and the span over which goodput is counted."""

    requests: list[TraceRequest] = Field(min_length=1)
    span_s: float = Field(gt=0, allow_inf_nan=False, description="goodput = requests meeting the SLOs / span_s")

    @classmethod
    def of(cls, requests: list[TraceRequest]) -> Workload:
        """Sorted by arrival. The span is the arrival window plus one mean gap, n/(n-1) x the last arrival (n
        requests one gap apart span n gaps); 1 s for a single request. Goodput is counted over it."""
        ordered = sorted(requests, key=lambda r: r.arrival_s)
        if not ordered:
            raise WorkloadError("the workload has no requests")
        n, last = len(ordered), ordered[-1].arrival_s
        return cls(requests=ordered, span_s=last * n / (n - 1) if n > 1 and last > 0 else 1.0)


def load_trace(path: Path) -> Workload:
    """Rows {arrival_s, prompt_tokens, output_tokens}, one JSON object per line (blank lines skipped)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            requests.append(TraceRequest.model_validate_json(line))
        except ValidationError as exc:
            raise WorkloadError(f"{path} line {number}: {describe(exc, TraceRequest)}") from None
    if not requests:
        raise WorkloadError(f"{path}: no requests (expected one JSON object per line)")
    return Workload.of(requests)


def write_trace(workload: Workload, path: Path) -> None:
    path.write_text("".join(r.model_dump_json() + "\n" for r in workload.requests))


class LengthDistribution(BaseModel):
    """Token lengths: `fixed` (low), `uniform` in [low, high], or `normal` (mean, std) rounded and kept >= 1."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["fixed", "uniform", "normal"]
    low: int = Field(ge=1, le=MAX_TOKENS, description="fixed: the length; uniform: the least; normal: the mean")
    high: int = Field(ge=0, le=MAX_TOKENS, description="uniform: the most; normal: the standard deviation")

    @model_validator(mode="after")
    def _ordered(self):
        if self.kind == "uniform" and self.high < self.low:
            raise ValueError(f"uniform needs low <= high, got low={self.low} high={self.high}")
        return self

    @classmethod
    def parse(cls, text: str) -> LengthDistribution:
        """`N`, `uniform:LO:HI` or `normal:MEAN:STD`."""
        parts = text.split(":")
        try:
            if len(parts) == 1:
                kind, low, high = "fixed", int(parts[0]), 0
            elif len(parts) == 3 and parts[0] in ("uniform", "normal"):
                kind, low, high = parts[0], int(parts[1]), int(parts[2])
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"{text!r} is not N, uniform:LO:HI or normal:MEAN:STD (whole numbers of tokens)") from None
        try:
            return cls(kind=kind, low=low, high=high)
        except ValidationError as exc:
            raise ValueError(describe(exc, cls)) from None

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.low
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        return min(MAX_TOKENS, max(1, round(rng.gauss(self.low, self.high))))


class SyntheticWorkload(BaseModel):
    """A seeded synthetic workload: `count` requests at `rate` per second, Poisson or evenly spaced."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rate: float = Field(gt=0, le=100_000, allow_inf_nan=False, description="requests per second")
    count: int = Field(ge=1, le=1_000_000, description="requests in the workload")
    prompt: LengthDistribution
    output: LengthDistribution
    arrivals: Literal["poisson", "uniform"] = "poisson"
    seed: int = 0

    @classmethod
    def parse(cls, text: str) -> SyntheticWorkload:
        """`rate=R,count=N,prompt=DIST,output=DIST[,arrivals=poisson|uniform][,seed=S]` (or duration=S for count)."""
        fields: dict[str, object] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise WorkloadError(f"{item!r} is not key=value")
            key = key.strip()
            if key in fields:
                raise WorkloadError(f"{key} given twice")
            if key in ("prompt", "output"):
                try:
                    fields[key] = LengthDistribution.parse(value.strip())
                except ValueError as exc:
                    raise WorkloadError(f"{key}: {exc}") from None
            else:
                fields[key] = value.strip()
        if "duration" in fields:
            if "count" in fields:
                raise WorkloadError("give count or duration, not both")
            try:
                fields["count"] = max(1, round(float(fields.pop("duration")) * float(fields["rate"])))
            except (KeyError, ValueError, OverflowError):  # OverflowError: an infinite duration
                raise WorkloadError("duration needs a finite number of seconds and a rate") from None
        try:
            return cls.model_validate(fields)
        except ValidationError as exc:
            raise WorkloadError(describe(exc, cls)) from None

    def generate(self) -> Workload:
        rng = random.Random(self.seed)
        requests, now = [], 0.0
        for i in range(self.count):
            if i:
                now += rng.expovariate(self.rate) if self.arrivals == "poisson" else 1 / self.rate
            requests.append(TraceRequest(arrival_s=round(now, 6), prompt_tokens=self.prompt.sample(rng),
                                         output_tokens=self.output.sample(rng)))
        return Workload.of(requests)


def describe(exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    """A pydantic error as `field: message; ...` (the field path dotted, pydantic's own wording), with the
    field's allowed range when `model` declares one."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "json_invalid":
            message = f"not a JSON object ({error['ctx'].get('error', '')})"
        allowed = field_range(model, str(error["loc"][0])) if model is not None and error["loc"] else None
        if allowed:
            message += f" (allowed: {allowed})" if error["type"] == "missing" else \
                f" (allowed: {allowed}, got {error['input']!r})"
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def field_range(model: type[BaseModel], name: str) -> str | None:
    """A numeric field's bounds as an interval, e.g. `(0, 100]`; None for a field without both."""
    info = model.model_fields.get(name)
    if info is None:
        return None
    low = high = None
    for rule in info.metadata:
        for attr, bracket in (("gt", "("), ("ge", "[")):
            if getattr(rule, attr, None) is not None:
                low = f"{bracket}{getattr(rule, attr)}"
        for attr, bracket in (("lt", ")"), ("le", "]")):
            if getattr(rule, attr, None) is not None:
                high = f"{getattr(rule, attr)}{bracket}"
    return f"{low}, {high}" if low and high else None
