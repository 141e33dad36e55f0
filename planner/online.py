"""The online planner: every `interval_s` it simulates the live window's workload on the live cost fits with the
same model `pdserve plan` uses, picks the prefill:decode counts, and damps the change.

One decision:
  1. The requests that arrived in the last `window_s` seconds, those in flight included (planner/live.py; fewer
     than `min_requests`, or no timings of a role yet: warming_up).
  2. Each cluster shape of at most `max_instances` (at least `min_per_role` of each role) is simulated, smallest
     first; the first size with a shape meeting both SLOs wins, of its shapes the one running now if it is one,
     else the one with the most goodput (`meets_slo`). A shape smaller than the cluster now must meet them with room to spare (each predicted
     percentile at most `scale_down_headroom` of its target). When none does, the shape of `max_instances`
     with the most goodput (`best_effort`). The newest half of the window is searched too, and each role gets
     the larger of the two counts: a load that grew is answered before it fills the whole window.
  3. Damping: the desired counts change only when `confirmations` decisions in a row agree on the new counts and
     `cooldown_s` has passed since the last change; fewer instances in all only after the decisions asked for
     them for `scale_down_after_s` (`held` until then).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.live import Attainment, Snapshot, costs
from planner.plan import Planner, Prediction
from planner.profile import WorkerProfile
from planner.settings import PlannerConfig
from planner.simulation import SimulationError, SimulationStalled, WorkerSettings
from planner.slo import Slo
from planner.workload import Workload

MIN_WARMUP_COPIES, MAX_WARMUP_COPIES = 2, 8
# A correction only tightens: the finished requests it is taken from are the short ones while a shift to long
# answers is under way (those are still running), and a loosened TPOT target would hide the shift.
MIN_CORRECTION, MAX_CORRECTION = 1.0, 3.0
REASONS = ("warming_up", "meets_slo", "best_effort", "cannot_simulate")


@dataclass(frozen=True)
class Decision:
    """One evaluation: the counts it arrived at (None while warming up or unable to simulate) and why."""

    reason: str  # one of REASONS
    message: str
    prefill: int | None = None
    decode: int | None = None
    prediction: Prediction | None = None
    attainment: Attainment | None = None
    workload: dict | None = None

    @property
    def counts(self) -> tuple[int, int] | None:
        return None if self.prefill is None else (self.prefill, self.decode)


def _profile(role: str, costs, kv_capacity: int) -> WorkerProfile:
    return WorkerProfile(role=role, worker="live", model="live", kv_capacity_tokens=kv_capacity, **{role: costs})


def shapes(config: PlannerConfig) -> list[list[tuple[int, int]]]:
    """The cluster shapes to consider, grouped by size, smallest first."""
    low = config.min_per_role
    return [[(p, total - p) for p in range(low, total - low + 1)] for total in range(2 * low, config.max_instances + 1)]


def decide(config: PlannerConfig, snapshot: Snapshot, settings: WorkerSettings, kv_capacity_tokens: int,
           current: tuple[int, int], policy: str = "load_balance", calibrate: bool = False) -> Decision:
    """Steps 1 and 2 of the module docstring (CPU-bound: the caller runs it off the event loop). `calibrate`:
    the window's requests ran on `current`, so what their clients saw corrects the model (`_corrected`)."""
    slo = Slo(ttft_ms=config.ttft_ms, tpot_ms=config.tpot_ms, percentile=config.percentile)
    workload, attainment = snapshot.workload, snapshot.attainment
    fits = costs(snapshot)
    if workload is None or len(workload.requests) < config.min_requests or fits is None:
        return Decision("warming_up", f"{attainment.requests} requests arrived in the last {config.window_s:g}s "
                        f"({snapshot.finished} finished); deciding from {config.min_requests} with timings of both "
                        "roles", attainment=attainment)
    profiles = _profile("prefill", fits[0], 0), _profile("decode", fits[1], kv_capacity_tokens)
    try:
        target, factors = slo, {"ttft": 1.0, "tpot": 1.0}
        if calibrate:
            target, factors = _corrected(slo, snapshot, workload, profiles, config, current, settings, policy)
        reason, chosen = _search(_planner(workload, profiles, target, config, settings, policy), config, current)
        # Scale up fast: a load that grew shows in the newest half of the window before it fills the whole.
        newest = _newest_half(workload, config.window_s)
        if newest is not None and len(newest.requests) >= config.min_requests:
            recent = _planner(newest, profiles, target, config, settings, policy)
            reason_now, now = _search(recent, config, current)
            counts = max(chosen.num_prefill, now.num_prefill), max(chosen.num_decode, now.num_decode)
            if counts != (chosen.num_prefill, chosen.num_decode):  # the newest half asks for more
                reason, workload = reason_now, newest
                chosen = now if sum(counts) > config.max_instances else recent.predict(*counts)
    except (SimulationError, SimulationStalled) as exc:
        return Decision("cannot_simulate", str(exc), attainment=attainment, workload=_summary(workload, fits, snapshot))
    return _decision(reason, chosen, slo, attainment, {**_summary(workload, fits, snapshot), "correction": factors})


def _corrected(slo: Slo, snapshot: Snapshot, workload: Workload, profiles, config: PlannerConfig,
               current: tuple[int, int], settings: WorkerSettings, policy: str) -> tuple[Slo, dict]:
    """The targets the search holds shapes to, corrected as Dynamo's planner does: each divided by what the clients
    saw over what the model predicts for the cluster running (the model leaves out the coordinator's relay and
    the machine's other work), within [MIN_CORRECTION, MAX_CORRECTION]."""
    observed, (prefill, decode) = snapshot.observed, current
    if observed is None or observed.requests < config.min_requests or min(prefill, decode) < 1:
        return slo, {"ttft": 1.0, "tpot": 1.0}
    predicted = _planner(workload, profiles, slo, config, settings, policy).predict(*current).report

    def factor(seen: float, modelled: float) -> float:
        return 1.0 if modelled <= 0 or seen <= 0 else min(MAX_CORRECTION, max(MIN_CORRECTION, seen / modelled))

    factors = {"ttft": round(factor(observed.ttft_ms, predicted.ttft_ms), 3),
               "tpot": round(factor(observed.tpot_ms, predicted.tpot_ms), 3)}
    return Slo(ttft_ms=slo.ttft_ms / factors["ttft"], tpot_ms=slo.tpot_ms / factors["tpot"],
               percentile=slo.percentile), factors


def _newest_half(workload: Workload, window_s: float) -> Workload | None:
    last = workload.requests[-1].arrival_s
    recent = [r for r in workload.requests if r.arrival_s >= last - window_s / 2]
    if len(recent) == len(workload.requests):
        return None
    start = recent[0].arrival_s
    return Workload(requests=[r.model_copy(update={"arrival_s": r.arrival_s - start}) for r in recent],
                    span_s=window_s / 2)


def _planner(workload, profiles, slo, config, settings, policy) -> Planner:
    """The window is replayed before the copy judged, for at least twice the time a long answer takes at the TPOT
    target (2 to 8 copies): a cluster simulated from empty never reaches the batches that answers longer than the
    window build up, and would look fine under a load it cannot hold."""
    requests = workload.requests
    long_answer = sorted(r.output_tokens for r in requests)[int(0.9 * (len(requests) - 1))]
    warm_s = 2 * long_answer * slo.tpot_ms / 1000
    copies = min(MAX_WARMUP_COPIES, max(MIN_WARMUP_COPIES, math.ceil(warm_s / workload.span_s)))
    tiled = [r.model_copy(update={"arrival_s": r.arrival_s + copy * workload.span_s})
             for copy in range(copies + 1) for r in requests]
    return Planner(Workload(requests=tiled, span_s=workload.span_s), *profiles, slo, settings, policy,
                   config.max_instances, warmup=copies * len(requests))


def _search(planner: Planner, config: PlannerConfig, current: tuple[int, int]) -> tuple[str, Prediction]:
    """Step 2's shape search over one workload, on the planner that simulates it (its predictions cached)."""
    slo = planner.slo

    def acceptable(m: Prediction) -> bool:
        # Fewer instances than run now only with room to spare: noise in the window must not shrink the cluster.
        room = 1.0 if m.num_prefill + m.num_decode >= sum(current) else config.scale_down_headroom
        return m.report.met and max(m.headroom(slo)) <= room

    def best(predictions: list[Prediction]) -> Prediction:
        return max(predictions, key=lambda m: (m.report.goodput_rps, -max(m.headroom(slo))))

    for size in shapes(config):
        meeting = [planner.predict(p, d) for p, d in size if acceptable(planner.predict(p, d))]
        kept = [m for m in meeting if (m.num_prefill, m.num_decode) == current]
        if kept:  # the split running meets them: no switch for a little more goodput (no flapping on noise)
            return "meets_slo", kept[0]
        if meeting:
            return "meets_slo", best(meeting)
    return "best_effort", best([planner.predict(p, d) for p, d in shapes(config)[-1]])


def _summary(workload: Workload, fits, snapshot: Snapshot) -> dict:
    requests = workload.requests
    prefill_fit, decode_fit = fits
    return {"requests": len(requests), "finished": snapshot.finished, "span_s": workload.span_s,
            "rate_rps": round(len(requests) / workload.span_s, 3),
            "prompt_tokens_mean": round(sum(r.prompt_tokens for r in requests) / len(requests), 1),
            "output_tokens_mean": round(sum(r.output_tokens for r in requests) / len(requests), 1),
            "fitted_costs": {
                "prefill_ms": f"{prefill_fit.base_ms:.2f} + {prefill_fit.ms_per_token:.4f} x prompt tokens",
                "decode_step_ms": f"{decode_fit.base_ms:.2f} + {decode_fit.ms_per_seq:.3f} x batch + "
                                  f"{decode_fit.ms_per_context_token:.6f} x context tokens",
                "points": {"prefill": len(prefill_fit.points), "decode": len(decode_fit.points)}}}


def _decision(reason: str, chosen: Prediction, slo: Slo, attainment: Attainment, summary: dict) -> Decision:
    report = chosen.report
    p = f"p{slo.percentile:g}"
    verdict = ("the fewest instances meeting the SLOs" if reason == "meets_slo" else
               "no shape within max_instances meets the SLOs: the one serving most within them")
    message = (f"{chosen.num_prefill} prefill + {chosen.num_decode} decode: {verdict}; predicted {p} TTFT "
               f"{report.ttft_ms:.0f} ms (target {slo.ttft_ms:g}), {p} TPOT {report.tpot_ms:.1f} ms (target "
               f"{slo.tpot_ms:g}) at {summary['rate_rps']:g} req/s, prompts {summary['prompt_tokens_mean']:g} and "
               f"answers {summary['output_tokens_mean']:g} tokens on average")
    return Decision(reason, message, chosen.num_prefill, chosen.num_decode, chosen, attainment, summary)


class Damper:
    """Step 3 of the module docstring: turns decisions into the desired counts."""

    def __init__(self, config: PlannerConfig):
        self.config = config
        self.desired: tuple[int, int] | None = None
        self.changed_at = float("-inf")
        self._streak: tuple[tuple[int, int] | None, int, float] = (None, 0, 0.0)  # counts, decisions, since

    def offer(self, decision: Decision, now: float) -> bool:
        """Take one decision; True when it changed the desired counts."""
        counts = decision.counts
        if counts is None:
            return False
        previous, streak, since = self._streak
        self._streak = (counts, streak + 1, since) if counts == previous else (counts, 1, now)
        _, streak, since = self._streak
        if counts == self.desired or streak < self.config.confirmations:
            return False
        if self.desired is not None:
            if now - self.changed_at < self.config.cooldown_s:
                return False
            if sum(counts) < sum(self.desired) and now - since < self.config.scale_down_after_s:
                return False  # fewer instances only after asking for them that long: a lull is not a trend
        self.desired, self.changed_at = counts, now
        return True

    def held(self, decision: Decision) -> bool:
        """Whether the decision's counts wait on the damping."""
        return decision.counts is not None and decision.counts != self.desired
