"""SLOs on TTFT and TPOT at a percentile, and how a set of request timings fares against them.

The same summary serves the planner's prediction and a measured run, so the two are compared like for like.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class Slo(BaseModel):
    """The p-th percentile of TTFT and of TPOT must each be within its target."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_ms: float = Field(gt=0, le=3_600_000, allow_inf_nan=False, description="time to first token, ms")
    tpot_ms: float = Field(gt=0, le=3_600_000, allow_inf_nan=False,
                           description="time per output token after the first, ms (the request's mean)")
    percentile: float = Field(default=90, gt=0, le=100, allow_inf_nan=False)


@dataclass(frozen=True)
class RequestTiming:
    """One request as its client saw it; TPOT = (last token - first token) / (output tokens - 1), 0 for one token."""

    ttft_ms: float
    tpot_ms: float


@dataclass(frozen=True)
class SloReport:
    """The percentile figures, whether they meet the SLO, and goodput: requests meeting both targets per second."""

    ttft_ms: float
    tpot_ms: float
    met: bool
    num_good: int
    num_requests: int
    goodput_rps: float

    def as_dict(self) -> dict:
        return {"ttft_ms": round(self.ttft_ms, 2), "tpot_ms": round(self.tpot_ms, 2), "slo_met": self.met,
                "good_requests": self.num_good, "requests": self.num_requests,
                "goodput_rps": round(self.goodput_rps, 3)}


def tpot_ms(first_token_s: float, last_token_s: float, num_tokens: int) -> float:
    return 0.0 if num_tokens <= 1 else (last_token_s - first_token_s) * 1000 / (num_tokens - 1)


def evaluate(timings: list[RequestTiming], slo: Slo, span_s: float) -> SloReport:
    """Percentiles interpolated linearly (numpy's default), over every request."""
    ttft = np.asarray([t.ttft_ms for t in timings])
    tpot = np.asarray([t.tpot_ms for t in timings])
    p_ttft = float(np.percentile(ttft, slo.percentile))
    p_tpot = float(np.percentile(tpot, slo.percentile))
    num_good = int(np.count_nonzero((ttft <= slo.ttft_ms) & (tpot <= slo.tpot_ms)))
    return SloReport(ttft_ms=p_ttft, tpot_ms=p_tpot, met=p_ttft <= slo.ttft_ms and p_tpot <= slo.tpot_ms,
                     num_good=num_good, num_requests=len(timings), goodput_rps=num_good / span_s)
