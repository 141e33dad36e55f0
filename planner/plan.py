"""`pdserve plan`: the fewest prefill and decode instances whose simulated TTFT and TPOT meet the SLOs.

Adding prefill instances never raises the modelled TTFT, so the fewest meeting the TTFT target with decode
ample is a lower bound on P. TPOT need not fall as prefill instances are added (faster prefill hands decode
bigger bursts), so from that bound every split of each total is simulated and the first total with a split
that meets both SLOs is the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.profile import WorkerProfile
from planner.simulation import ClusterModel, Policy, WorkerSettings, simulate
from planner.slo import Slo, SloReport, evaluate
from planner.workload import Workload


class NoPlanError(RuntimeError):
    """No cluster within the instance limit meets the SLOs; the message says which role falls short."""


@dataclass(frozen=True)
class Prediction:
    """One cluster shape, simulated."""

    num_prefill: int
    num_decode: int
    report: SloReport
    prefill_utilisation: float
    decode_utilisation: float
    mean_decode_batch: float

    def headroom(self, slo: Slo) -> tuple[float, float]:
        """How close each SLO is to its limit: (p-th TTFT / target, p-th TPOT / target)."""
        return self.report.ttft_ms / slo.ttft_ms, self.report.tpot_ms / slo.tpot_ms


@dataclass(frozen=True)
class Recommendation:
    chosen: Prediction
    bottleneck: str  # the role whose SLO has the least headroom: prefill (TTFT) or decode (TPOT)
    one_fewer: dict[str, Prediction | None]  # per role: the same cluster less one of it (None: it has only one)

    def as_dict(self) -> dict:
        def shape(p: Prediction) -> dict:
            return {"prefill": p.num_prefill, "decode": p.num_decode, **p.report.as_dict(),
                    "prefill_utilisation": round(p.prefill_utilisation, 3),
                    "decode_utilisation": round(p.decode_utilisation, 3),
                    "mean_decode_batch": round(p.mean_decode_batch, 2)}

        return {**shape(self.chosen), "bottleneck": self.bottleneck,
                "one_fewer": {role: None if p is None else shape(p) for role, p in self.one_fewer.items()}}


class Planner:
    """Simulates cluster shapes for one workload, profiles and SLO, remembering each shape's prediction."""

    def __init__(self, workload: Workload, prefill: WorkerProfile, decode: WorkerProfile, slo: Slo,
                 settings: WorkerSettings | None = None, policy: Policy = "load_balance", max_instances: int = 64,
                 warmup: int = 0):
        """`warmup`: the workload's first requests only load the cluster (a live window replayed: the planner
        tiles it), the SLOs are judged on the rest."""
        self.workload = workload
        self.warmup = warmup
        self.slo = slo
        self.max_instances = max_instances
        self.model = ClusterModel(num_prefill=1, num_decode=1, prefill=prefill.prefill, decode=decode.decode,
                                  decode_kv_capacity_tokens=decode.kv_capacity_tokens,
                                  settings=settings or WorkerSettings(), policy=policy)
        self._predictions: dict[tuple[int, int], Prediction] = {}

    def predict(self, num_prefill: int, num_decode: int) -> Prediction:
        key = (num_prefill, num_decode)
        if key not in self._predictions:
            result = simulate(replace(self.model, num_prefill=num_prefill, num_decode=num_decode), self.workload)
            self._predictions[key] = Prediction(num_prefill, num_decode,
                                                evaluate(result.timings[self.warmup:], self.slo,
                                                         self.workload.span_s),
                                                result.prefill_utilisation, result.decode_utilisation,
                                                result.mean_decode_batch)
        return self._predictions[key]

    def _least_prefill(self) -> int:
        """The fewest prefill instances meeting the TTFT target with max_instances decode instances."""
        for count in range(1, self.max_instances + 1):
            if self.predict(count, self.max_instances).headroom(self.slo)[0] <= 1:
                return count
        raise NoPlanError(f"even {self.max_instances} prefill instances miss p{self.slo.percentile:g} TTFT "
                          f"{self.slo.ttft_ms:g} ms (is it below one prompt's own prefill time? --max-instances "
                          f"raises the limit)")

    def recommend(self) -> Recommendation:
        least_prefill = self._least_prefill()
        ample = self.predict(self.max_instances, self.max_instances)
        if not ample.report.met:
            raise NoPlanError(f"even {self.max_instances} instances of each role miss p{self.slo.percentile:g} TPOT "
                              f"{self.slo.tpot_ms:g} ms (predicted {ample.report.tpot_ms:.1f} ms; is it below one "
                              f"decode step? --max-instances raises the limit)")
        for total in range(least_prefill + 1, 2 * self.max_instances + 1):
            shapes = [(p, total - p) for p in range(least_prefill, total)
                      if p <= self.max_instances and total - p <= self.max_instances]
            meeting = [self.predict(p, d) for p, d in shapes if self.predict(p, d).report.met]
            if meeting:
                # Of equal size, the one serving the most within the SLOs, then the one with the most headroom.
                chosen = max(meeting, key=lambda m: (m.report.goodput_rps, -max(m.headroom(self.slo))))
                return self._explain(chosen)
        raise AssertionError("unreachable: the ample cluster meets the SLOs")

    def _explain(self, chosen: Prediction) -> Recommendation:
        ttft_ratio, tpot_ratio = chosen.headroom(self.slo)
        one_fewer = {
            "prefill": self.predict(chosen.num_prefill - 1, chosen.num_decode) if chosen.num_prefill > 1 else None,
            "decode": self.predict(chosen.num_prefill, chosen.num_decode - 1) if chosen.num_decode > 1 else None,
        }
        return Recommendation(chosen, "prefill" if ttft_ratio >= tpot_ratio else "decode", one_fewer)
