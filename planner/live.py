"""What the online planner knows of live traffic: each finished request as the coordinator saw it, and the
workers' own timings of it, made into a workload to simulate and into cost fits (`planner/profile.py`).

A request counts from its arrival: the window holds the requests in flight too (their output so far, or what
they will surely make), so a shift shows before its long answers end. The timings are the workers' own, as they report them with every request: the prefill worker's forward and the
KV handoff (a PrefillPoint per request), and the decode worker's step time per token with the batch it ran in
(a DecodePoint per request: its median step, at the decode instance's batch when it finished). A prompt's
cached blocks make its forward cheaper, so the prefill fit is an effective cost per prompt token, cache hits
included.
"""

from __future__ import annotations

import contextlib
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from planner.profile import DecodeCosts, DecodePoint, PrefillCosts, PrefillPoint, WorkerProfile
from planner.settings import PlannerConfig
from planner.slo import Slo
from planner.workload import TraceRequest, Workload


@dataclass
class LiveRequest:
    """One request from its arrival (time.monotonic): its prompt, the output it will surely make (`least_output`:
    max_tokens with ignore_eos, else min_tokens), `progress` (anything with `count`, `first_at` and `last_at`: its
    tokens so far), and once it finished its latencies."""

    arrived_s: float
    prompt_tokens: int
    least_output: int
    progress: object
    finished: bool = False
    output_tokens: int = 0
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0


@dataclass(frozen=True)
class Attainment:
    """The share of the window's requests within each target, and within both."""

    ttft: float
    tpot: float
    both: float
    requests: int

    def as_dict(self) -> dict:
        return {"ttft": round(self.ttft, 4), "tpot": round(self.tpot, 4), "both": round(self.both, 4),
                "requests": self.requests}


@dataclass(frozen=True)
class RequestTimingSummary:
    """The p-th percentile TTFT and TPOT of the window's finished requests."""

    ttft_ms: float
    tpot_ms: float
    requests: int


@dataclass(frozen=True)
class Snapshot:
    """What one decision needs, small enough to hand to another process: the window's requests as (prompt, output
    so far or expected) at their arrivals, the attainment, and the timings kept."""

    workload: Workload | None
    attainment: Attainment
    finished: int
    prefill_points: tuple[PrefillPoint, ...]
    decode_points: tuple[DecodePoint, ...]
    decode_profiled: bool = False  # the decode points include a profile's
    observed: RequestTimingSummary | None = None  # the finished requests' percentiles, as their clients saw them


class LiveWorkload:
    """The requests that arrived in the last `window_s` seconds, and the newest `profile_points` timings per role."""

    def __init__(self, config: PlannerConfig):
        self.config = config
        self.slo = Slo(ttft_ms=config.ttft_ms, tpot_ms=config.tpot_ms, percentile=config.percentile)
        self.requests: deque[LiveRequest] = deque()
        self.prefill_points: deque[PrefillPoint] = deque(maxlen=config.profile_points)
        self.decode_points: deque[DecodePoint] = deque(maxlen=config.profile_points)
        # A profile's points stay beside the live ones: they span the batch sizes and prompt lengths live traffic
        # may not (a fit on batches all alike cannot tell a step's fixed cost from its cost per sequence).
        self.seeds = {"prefill": _profile_points(config.prefill_profile, "prefill"),
                      "decode": _profile_points(config.decode_profile, "decode")}

    def arrive(self, arrived_s: float, prompt_tokens: int, least_output: int, progress) -> LiveRequest:
        request = LiveRequest(arrived_s, prompt_tokens, max(1, least_output), progress)
        self.requests.append(request)
        return request

    def abandon(self, request: LiveRequest) -> None:
        """A request that failed or whose client left: not part of the workload."""
        with contextlib.suppress(ValueError):
            self.requests.remove(request)

    def record(self, request: LiveRequest, ttft_ms: float, tpot_ms: float, forward_ms: float, handoff_ms: float,
               kv_bytes: int, step_ms: list[float], batch_size: int) -> None:
        """`request` finished; `step_ms` is its decode worker's step time for each token after the first, made in
        batches of `batch_size` on average."""
        output = request.progress.count
        request.finished, request.output_tokens, request.ttft_ms, request.tpot_ms = True, output, ttft_ms, tpot_ms
        if forward_ms > 0:  # 0: the decode worker prefilled it itself, or a vLLM instance (no timings)
            self.prefill_points.append(PrefillPoint(prompt_tokens=request.prompt_tokens, prefill_ms=forward_ms,
                                                    handoff_ms=handoff_ms, kv_bytes=kv_bytes))
        steps = [s for s in step_ms if s > 0]
        if steps:
            batch = max(1, batch_size)
            # The batch's context: its sequences taken as long as this one, halfway through its answer.
            context = batch * (request.prompt_tokens + output // 2)
            self.decode_points.append(DecodePoint(batch_size=batch, context_tokens=max(1, context),
                                                  step_ms=statistics.median(steps)))

    def snapshot(self, now: float) -> Snapshot:
        """The window's requests (older ones are dropped): finished ones as they were; one in flight with the
        most of its tokens so far + 1, its least output, and the mean output of the window's finished ones."""
        while self.requests and self.requests[0].arrived_s < now - self.config.window_s:
            self.requests.popleft()
        done = [r for r in self.requests if r.finished]
        typical = round(sum(r.output_tokens for r in done) / len(done)) if done else 1
        trace, ttft_ok, tpot_ok, both_ok = [], 0, 0, 0
        first = self.requests[0].arrived_s if self.requests else now
        for r in self.requests:
            if r.finished:
                output, ttft, tpot = r.output_tokens, r.ttft_ms, r.tpot_ms
            else:  # so far: a request still waiting past the TTFT target, or streaming slower, has missed it
                count = r.progress.count
                output = max(count + 1, r.least_output, typical)
                ttft = (now - r.arrived_s) * 1000 if count == 0 else (r.progress.first_at - r.arrived_s) * 1000
                tpot = (r.progress.last_at - r.progress.first_at) * 1000 / (count - 1) if count > 1 else 0.0
            ttft_ok += ttft <= self.slo.ttft_ms
            tpot_ok += tpot <= self.slo.tpot_ms
            both_ok += ttft <= self.slo.ttft_ms and tpot <= self.slo.tpot_ms
            trace.append(TraceRequest(arrival_s=round(r.arrived_s - first, 6), prompt_tokens=r.prompt_tokens,
                                      output_tokens=max(1, output)))
        n = len(trace)
        attainment = Attainment(ttft_ok / n, tpot_ok / n, both_ok / n, n) if n else Attainment(1.0, 1.0, 1.0, 0)
        workload = Workload(requests=trace, span_s=self.config.window_s) if trace else None
        observed = None
        if done:
            observed = RequestTimingSummary(float(np.percentile([r.ttft_ms for r in done], self.slo.percentile)),
                                            float(np.percentile([r.tpot_ms for r in done], self.slo.percentile)),
                                            len(done))
        return Snapshot(workload, attainment, len(done), self.seeds["prefill"] + tuple(self.prefill_points),
                        self.seeds["decode"] + tuple(self.decode_points), bool(self.seeds["decode"]), observed)


def _profile_points(path: str, role: str) -> tuple:
    """The points of a `pdserve profile` file (ProfileError, naming the file, fails start-up); () without one."""
    if not path:
        return ()
    profile = WorkerProfile.load(Path(path), role)
    return tuple((profile.prefill or profile.decode).points)


def costs(snapshot: Snapshot) -> tuple[PrefillCosts, DecodeCosts] | None:
    """The cost fits of the timings kept; None until both roles have some."""
    if not snapshot.prefill_points or not snapshot.decode_points:
        return None
    # A live point's context is its batch times a typical length, so only a profile's points (batches at several
    # context lengths) can price context apart from the batch.
    return PrefillCosts.fit(list(snapshot.prefill_points)), DecodeCosts.fit(list(snapshot.decode_points),
                                                                            with_context=snapshot.decode_profiled)
