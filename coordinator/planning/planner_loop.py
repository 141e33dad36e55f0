"""Runs the online planner (planner/online.py) beside the coordinator: every finished request is recorded, and
every `planner_config.interval_s` a decision is made in a separate process (the simulation is CPU-bound and
must not hold the event loop), damped, logged, exported as metrics and shown by `GET /v1/plan`.

On etcd only the active coordinator (the leader key's holder) decides; a standby reports that it is one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import time
from collections import deque

from coordinator.periodic_rounds import PeriodicRounds
from coordinator.requests.attempt import Progress
from coordinator.requests.request import GenerationRequest
from coordinator.requests.trace import GenerationTrace
from coordinator.workers.instances import InstanceRegistry
from planner.encoders import EncoderDemand
from planner.live import LiveRequest, LiveWorkload
from planner.online import REASONS, Damper, Decision, decide
from planner.settings import PlannerConfig
from planner.simulation import WorkerSettings

logger = logging.getLogger(__name__)

HISTORY = 20  # changes of the desired counts kept for GET /v1/plan


class PlannerLoop:
    """The planner's state in one coordinator: live requests in, decisions out."""

    def __init__(self, config: PlannerConfig, registry: InstanceRegistry, policy: str, cluster=None):
        self.config = config
        self.registry = registry
        self.cluster = cluster
        # The simulation models load_balance and round_robin; cache_affinity balances load like the first.
        self.policy = "round_robin" if policy == "round_robin" else "load_balance"
        self.live = LiveWorkload(config)
        self.damper = Damper(config)
        self.encoders = EncoderDemand(config)  # encode workers: counted apart (planner/encoders.py)
        self.encode_desired: int | None = None
        self.last: Decision | None = None
        self.decided_at = 0.0
        self.decisions = {reason: 0 for reason in (*REASONS, "held")}
        self.history: deque[dict] = deque(maxlen=HISTORY)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self.rounds = PeriodicRounds(self.step, config.interval_s, "planner decision")

    # the pipeline's side ------------------------------------------------------------------------------------
    def arrived(self, request: GenerationRequest, max_tokens: int, progress: Progress) -> LiveRequest:
        """A request left the queue for the workers: it counts in the workload from its arrival."""
        sampling = request.sampling
        least = max_tokens if sampling.ignore_eos else sampling.min_tokens
        return self.live.arrive(request.arrived_at, len(request.prompt_token_ids), least, progress)

    def finished(self, live: LiveRequest, trace: GenerationTrace) -> None:
        """It finished: its latencies as its client saw them, and its workers' timings."""
        progress = live.progress
        if progress.count == 0:
            self.live.abandon(live)
            return
        tpot = (progress.last_at - progress.first_at) * 1000 / (progress.count - 1) if progress.count > 1 else 0.0
        durations = trace.durations
        # Another attempt's prefill (a retry, a migration, a move) adds its forward to the first's: no timing then.
        forward_s = durations.get("prefill_forward", 0.0) if progress.attempts == 1 else 0.0
        self.live.record(live, (progress.first_at - live.arrived_s) * 1000, tpot,
                         forward_ms=forward_s * 1000,
                         handoff_ms=durations.get("kv_transfer", 0.0) * 1000, kv_bytes=trace.kv_bytes,
                         step_ms=progress.decode_times, batch_size=round(progress.batch_sum / progress.count))

    def abandoned(self, live: LiveRequest) -> None:
        self.live.abandon(live)

    def encoded(self, busy_s: float, images: int) -> None:
        """An Encode call answered (requests/encoding.py): its time on the encode worker, the images it encoded."""
        self.encoders.record(time.monotonic(), busy_s, images)

    # the decisions --------------------------------------------------------------------------------------------
    @property
    def deciding(self) -> bool:
        """Whether this coordinator decides: alone, or the active one on etcd."""
        return self.cluster is None or self.cluster.role.value == "active"

    def current(self) -> tuple[int, int]:
        return len(self.registry.available("prefill")), len(self.registry.available("decode"))

    def current_encoders(self) -> int:
        return len(self.registry.available("encode"))

    def _kv_capacity(self) -> int:
        capacities = [i.reported.kv_capacity_tokens for i in self.registry.instances("decode")
                      if i.reported.kv_capacity_tokens]
        return min(capacities, default=0)

    async def step(self) -> Decision | None:
        """One decision (None on a standby)."""
        if not self.deciding:
            return None
        now = time.monotonic()
        # What the cluster is, or is becoming: the counts last asked for, else those routable now; what the clients
        # saw corrects the model only once the cluster is what was asked for.
        routable = self.current()
        shape = self.damper.desired or routable
        decision = await asyncio.get_running_loop().run_in_executor(
            self._pool, decide, self.config, self.live.snapshot(now), WorkerSettings(), self._kv_capacity(), shape,
            self.policy, shape == routable)
        self.last, self.decided_at = decision, time.time()
        changed = self.damper.offer(decision, now)
        encoders = self.current_encoders()
        encode_desired = self.encoders.decide(now, encoders, self.config.max_instances - sum(shape) - encoders)
        if encode_desired != self.encode_desired and self.encode_desired is not None:
            logger.info("planner: desired %d encode workers (now %d): %.2f busy over the last %gs", encode_desired,
                        encoders, self.encoders.busy_share(now), self.config.window_s)
        self.encode_desired = encode_desired or None
        held = not changed and self.damper.held(decision)
        self.decisions["held" if held else decision.reason] += 1
        if changed:
            prefill, decode = self.damper.desired
            entry = {"at": round(self.decided_at, 3), "prefill": prefill, "decode": decode,
                     "current": self.describe_counts("current"), "reason": decision.reason, "message": decision.message}
            self.history.append(entry)
            logger.info("planner: desired %d prefill + %d decode (now %d + %d): %s", prefill, decode,
                        *self.current(), decision.message)
        return decision

    def start(self) -> None:
        # spawn: a fork of a process running gRPC's threads is not safe
        self._pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        self.rounds.start()

    async def stop(self) -> None:
        await self.rounds.stop()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def describe_counts(self, which: str) -> dict[str, int]:
        """The `current` (routable) or `desired` count of each role; encode only where there are encode workers."""
        desired = self.damper.desired
        if which == "desired" and desired is None:
            return {}
        counts = dict(zip(("prefill", "decode"), self.current() if which == "current" else desired))
        encoders = self.current_encoders()
        if encoders or self.encode_desired:
            counts["encode"] = encoders if which == "current" else self.encode_desired or 0
        return counts

    def describe(self) -> dict:
        """GET /v1/plan."""
        decision = self.last
        answer = {
            "enabled": True, "deciding": self.deciding,
            "slo": self.live.slo.model_dump(),
            "current": self.describe_counts("current"),
            "desired": self.describe_counts("desired") or None,
            "decisions": dict(self.decisions), "history": list(self.history),
            "profile_points": {"prefill": len(self.live.prefill_points), "decode": len(self.live.decode_points)},
        }
        if decision is not None:
            answer["last"] = {
                "at": round(self.decided_at, 3), "reason": decision.reason, "message": decision.message,
                "held": self.damper.held(decision),
                "counts": None if decision.counts is None else dict(zip(("prefill", "decode"), decision.counts)),
                "attainment": decision.attainment.as_dict() if decision.attainment else None,
                "workload": decision.workload,
                "prediction": None if decision.prediction is None else {
                    "prefill_utilisation": round(decision.prediction.prefill_utilisation, 3),
                    "decode_utilisation": round(decision.prediction.decode_utilisation, 3),
                    **decision.prediction.report.as_dict()},
            }
        return answer

