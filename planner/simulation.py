"""A discrete-event model of a pdserve cluster serving a workload, timed by worker profiles.

A request's life, as the coordinator and the workers run it:

1. On arrival the coordinator picks a decode and a prefill instance (`load_balance`: the fewest outstanding
   requests / prompt tokens, ties in turn; `round_robin`: in turn).
2. The decode instance admits it when its KV budget holds prompt + output tokens (first come, first served).
3. The prefill instance queues the prompt; its engine batches queued prompts with the worker's own
   PrefillScheduler and a forward of the batch's padded tokens takes the profile's prefill time.
4. After the forward and the handoff (KV tail, ack, RPC) the decode instance emits the first token (TTFT) and
   the sequence joins its batch at the next step (up to max_running, DecodeScheduler again); every step
   takes the profile's step time at the batch size and context, and gives each running sequence a token.

Coordinator and network overheads beyond the profiled handoff are not modelled; nor are failures.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from planner.profile import DecodeCosts, PrefillCosts
from planner.slo import RequestTiming, tpot_ms
from planner.workload import TraceRequest, Workload
from worker.engine.scheduler import DecodeScheduler, PrefillScheduler

Policy = Literal["load_balance", "round_robin"]


class SimulationError(ValueError):
    """A workload this cluster can never serve (a request over a decode worker's KV budget)."""


@dataclass(frozen=True)
class WorkerSettings:
    """The worker flags the model must share with the real workers (defaults: `pdserve worker`'s)."""

    max_running: int = 64
    max_prefill_tokens: int = 8192
    max_prefill_batch_size: int = 16


@dataclass(frozen=True)
class ClusterModel:
    """P prefill and D decode instances, all alike, and the coordinator's policy."""

    num_prefill: int
    num_decode: int
    prefill: PrefillCosts
    decode: DecodeCosts
    decode_kv_capacity_tokens: int = 0  # 0: not limiting
    settings: WorkerSettings = WorkerSettings()
    policy: Policy = "load_balance"


@dataclass(eq=False)  # identity, as the schedulers compare with `in`
class _Request:
    trace: TraceRequest
    decode: _DecodeInstance
    prefill: _PrefillInstance
    status: object = None  # DecodeScheduler.finish writes it
    generated: int = 0
    first_token_s: float = 0.0
    last_token_s: float = 0.0

    @property
    def num_tokens(self) -> int:  # what PrefillScheduler batches by
        return self.trace.prompt_tokens

    @property
    def reservation(self) -> int:
        return self.trace.prompt_tokens + self.trace.output_tokens


@dataclass(eq=False)
class _PrefillInstance:
    scheduler: PrefillScheduler
    busy: bool = False
    outstanding_tokens: int = 0
    busy_s: float = 0.0


@dataclass(eq=False)
class _DecodeInstance:
    scheduler: DecodeScheduler
    kv_free: int
    stepping: bool = False
    outstanding: int = 0
    admission: deque = field(default_factory=deque)
    busy_s: float = 0.0
    batch_seconds: float = 0.0  # sum of batch size x step time: mean batch = this / busy_s


@dataclass(frozen=True)
class SimulationResult:
    timings: list[RequestTiming]  # in the workload's order
    prefill_utilisation: float  # share of the time the prefill instances spent in forwards
    decode_utilisation: float  # share of the time the decode instances spent in steps
    mean_decode_batch: float  # sequences per step, over the steps run


class _Router:
    """The coordinator's policies (coordinator/scheduling/policies.py) over identical instances."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.turns = {"prefill": 0, "decode": 0}

    def choose(self, role: str, instances: list, load: Callable[[object], float]):
        candidates = instances
        if self.policy == "load_balance":
            least = min(load(i) for i in instances)
            candidates = [i for i in instances if load(i) == least]
        choice = candidates[self.turns[role] % len(candidates)]
        self.turns[role] += 1
        return choice


class ClusterSimulation:
    """One run of a workload on a ClusterModel; `run()` once."""

    def __init__(self, cluster: ClusterModel, workload: Workload):
        self.cluster = cluster
        self.workload = workload
        settings = cluster.settings
        self.prefills = [
            _PrefillInstance(PrefillScheduler(settings.max_prefill_tokens, settings.max_prefill_batch_size))
            for _ in range(cluster.num_prefill)]
        capacity = cluster.decode_kv_capacity_tokens or float("inf")
        self.decodes = [_DecodeInstance(DecodeScheduler(settings.max_running), capacity)
                        for _ in range(cluster.num_decode)]
        self.router = _Router(cluster.policy)
        self._events: list = []
        self._order = itertools.count()
        self.now = 0.0

    def _at(self, when: float, action: Callable, *args) -> None:
        heapq.heappush(self._events, (when, next(self._order), action, args))

    def run(self) -> SimulationResult:
        capacity = self.cluster.decode_kv_capacity_tokens
        requests = []
        for trace in self.workload.requests:
            if capacity and trace.prompt_tokens + trace.output_tokens > capacity:
                raise SimulationError(f"a request of {trace.prompt_tokens} prompt + {trace.output_tokens} output "
                                      f"tokens never fits a decode worker's KV budget ({capacity} tokens)")
            self._at(trace.arrival_s, self._arrive, trace, requests)
        while self._events:
            self.now, _, action, args = heapq.heappop(self._events)
            action(*args)
        start = self.workload.requests[0].arrival_s
        elapsed = max(max(r.last_token_s for r in requests) - start, 1e-9)
        decode_busy = sum(d.busy_s for d in self.decodes)
        return SimulationResult(
            timings=[RequestTiming((r.first_token_s - r.trace.arrival_s) * 1000,
                                   tpot_ms(r.first_token_s, r.last_token_s, r.trace.output_tokens)) for r in requests],
            prefill_utilisation=sum(p.busy_s for p in self.prefills) / (len(self.prefills) * elapsed),
            decode_utilisation=decode_busy / (len(self.decodes) * elapsed),
            mean_decode_batch=sum(d.batch_seconds for d in self.decodes) / decode_busy if decode_busy else 0.0)

    def _arrive(self, trace: TraceRequest, requests: list[_Request]) -> None:
        decode = self.router.choose("decode", self.decodes, lambda d: d.outstanding)
        prefill = self.router.choose("prefill", self.prefills, lambda p: p.outstanding_tokens)
        request = _Request(trace, decode, prefill)
        requests.append(request)
        decode.outstanding += 1
        if decode.admission or decode.kv_free < request.reservation:
            decode.admission.append(request)
        else:
            self._admit(request)

    def _admit(self, request: _Request) -> None:
        request.decode.kv_free -= request.reservation
        prefill = request.prefill
        prefill.outstanding_tokens += request.num_tokens
        prefill.scheduler.add(request)
        if not prefill.busy:
            prefill.busy = True
            self._at(self.now, self._start_prefill, prefill)  # after the other arrivals of this instant, as a wake-up

    def _start_prefill(self, prefill: _PrefillInstance) -> None:
        batch = prefill.scheduler.next_batch()
        prefill.busy = bool(batch)
        if batch:
            duration = self.cluster.prefill.prefill_ms(max(r.num_tokens for r in batch) * len(batch)) / 1000
            prefill.busy_s += duration
            self._at(self.now + duration, self._prefill_done, prefill, batch)

    def _prefill_done(self, prefill: _PrefillInstance, batch: list[_Request]) -> None:
        for request in batch:
            self._at(self.now + self.cluster.prefill.handoff_ms(request.num_tokens) / 1000, self._kv_arrived, request)
        self._start_prefill(prefill)

    def _kv_arrived(self, request: _Request) -> None:
        request.prefill.outstanding_tokens -= request.num_tokens
        request.first_token_s = request.last_token_s = self.now
        request.generated = 1
        if request.generated >= request.trace.output_tokens:
            self._release(request)
            return
        decode = request.decode
        decode.scheduler.add(request)
        if not decode.stepping:
            decode.stepping = True
            self._at(self.now, self._start_step, decode)  # caches arriving this same instant join the same step

    def _start_step(self, decode: _DecodeInstance) -> None:
        _, batch = decode.scheduler.schedule()
        decode.stepping = bool(batch)
        if batch:
            context = sum(r.trace.prompt_tokens + r.generated for r in batch)
            duration = self.cluster.decode.step_ms(len(batch), context) / 1000
            decode.busy_s += duration
            decode.batch_seconds += len(batch) * duration
            self._at(self.now + duration, self._step_done, decode, batch)

    def _step_done(self, decode: _DecodeInstance, batch: list[_Request]) -> None:
        for request in batch:
            request.generated += 1
            request.last_token_s = self.now
            if request.generated >= request.trace.output_tokens:
                decode.scheduler.finish(request)
                self._release(request)
        self._start_step(decode)

    def _release(self, request: _Request) -> None:
        decode = request.decode
        decode.outstanding -= 1
        decode.kv_free += request.reservation
        while decode.admission and decode.kv_free >= decode.admission[0].reservation:
            self._admit(decode.admission.popleft())


def simulate(cluster: ClusterModel, workload: Workload) -> SimulationResult:
    return ClusterSimulation(cluster, workload).run()
