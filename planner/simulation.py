"""A discrete-event model of a pdserve cluster serving a workload, timed by worker profiles.

The workers' own BlockPool, PrefillScheduler and DecodeScheduler decide what runs, chunk by chunk and step by
step; the profiles give only how long each forward takes. A request's life, as the coordinator and the
workers run it:

1. On arrival the coordinator picks a decode and a prefill instance (`load_balance`: the fewest outstanding
   requests / prompt tokens, ties in turn; `round_robin`: in turn).
2. The decode instance admits it when its KV budget (the decode profile's KV capacity) holds the prompt and
   the first token, first come, first served; the rest of its output takes blocks as it grows (step 4).
3. The prefill instance queues the prompt in its PrefillScheduler, which cuts the queue into chunks of at
   most max_prefill_tokens per forward (the oldest prompt first, younger ones filling the rest, up to
   max_prefill_batch_size prompts); a forward takes the prefill profile's time at the tokens it computes,
   not at a padded width. Blocks found in the prefix cache are not computed, but the workload's prompts
   share no prefix (every token of request i is i), so a request only ever finds its own blocks, when it is
   recomputed (step 4).
4. After its last chunk and the handoff (KV tail, ack, RPC) the decode instance emits the first token (TTFT),
   the prefill instance's blocks go back to its pool, and the sequence waits for the DecodeScheduler to let
   it join the batch: a seat (max_running) and blocks of the instance's pool (the KV capacity in
   block_size-token blocks) for its positions. Every step takes the decode profile's step time at the batch
   size and context and gives each sequence in the batch a token; a sequence takes a block whenever it
   fills one. When the pool is dry the youngest running sequence is preempted: its blocks are released
   (full ones stay cached) and it is recomputed in chunks that share later steps (a step costing the prefill
   profile's time at its chunks' tokens besides its decode time), then joins again.

Not modelled: coordinator and network overheads beyond the profiled handoff, the prefill workers' KV budget,
failures.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from planner.profile import DecodeCosts, PrefillCosts
from planner.slo import RequestTiming, tpot_ms
from planner.workload import TraceRequest, Workload
from worker.engine.block_pool import BlockPool, BlockTable
from worker.engine.kv_budget import KvBudget
from worker.engine.messages import Recompute
from worker.engine.scheduler import Chunk, DecodeScheduler, PrefillScheduler

Policy = Literal["load_balance", "round_robin"]


class SimulationError(ValueError):
    """A workload this cluster can never serve (a request over a decode worker's KV budget)."""


class SimulationStalled(RuntimeError):
    """The workers' schedulers stopped with requests unfinished and nothing left to run: a deadlock in them, which
    the real workers would meet too (they would wait until the coordinator gave up), not a prediction."""


@dataclass(frozen=True)
class WorkerSettings:
    """The worker flags the model must share with the real workers (defaults: `pdserve worker`'s)."""

    max_running: int = 64
    max_prefill_tokens: int = 2048  # per forward: a prefill worker's prompts, a decode worker's recomputations
    max_prefill_batch_size: int = 16
    block_size: int = 16


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


class _Tokens(SequenceABC):
    """A request's tokens: `length` copies of its own id, so no two requests share a block (a list in all but
    memory: prompts of a million tokens cost nothing)."""

    __slots__ = ("token", "length")

    def __init__(self, token: int, length: int):
        self.token = token
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.token] * len(range(*index.indices(self.length)))
        if not -self.length <= index < self.length:
            raise IndexError(index)
        return self.token


class _UnlimitedPool(BlockPool):
    """A BlockPool that never runs dry, for KV the model does not limit (every prefill instance; a decode instance
    without a KV capacity): it adds blocks when an allocation would fail, so it holds about the most ever in use.

    Nothing in it is ever found in the prefix cache (its prompts share no prefix with one another, and with no
    preemption nothing is recomputed), so it keeps no record of block contents: hashing them would be most of a
    simulation's time, and change nothing."""

    def __init__(self, block_size: int):
        super().__init__(2, block_size)

    def can_grow(self, table: BlockTable, num_tokens: int) -> bool:
        return True

    def grow(self, table: BlockTable, num_tokens: int) -> bool:
        if super().grow(table, num_tokens):
            return True
        short = self.blocks_for(num_tokens) - table.num_blocks - self.num_free
        self.add_blocks(max(short, self.num_blocks))  # doubling: appends stay cheap
        return super().grow(table, num_tokens)

    def register(self, table: BlockTable, token_ids, num_computed: int) -> None:
        return


@dataclass(eq=False)  # identity, as the schedulers compare with `in`
class _Request:
    """One request; on its decode instance, the Sequence its DecodeScheduler sees (the fields it reads)."""

    index: int
    trace: TraceRequest
    decode: _DecodeInstance
    prefill: _PrefillInstance
    prompt_len: int
    output_tokens: int
    generated: int = 0
    table: BlockTable = field(default_factory=BlockTable)  # its blocks on the decode instance
    num_computed: int = 0  # positions with KV in `table`
    status: object = None  # DecodeScheduler.finish writes it
    first_token_s: float = 0.0
    last_token_s: float = 0.0

    @property
    def request_id(self) -> str:
        return str(self.index)

    @property
    def prompt_token_ids(self) -> _Tokens:
        return _Tokens(self.index, self.prompt_len)

    @property
    def token_ids(self) -> _Tokens:
        return _Tokens(self.index, self.prompt_len + self.generated)

    cache_token_ids = token_ids  # text prompts: hashed as their tokens
    media: ClassVar[tuple] = ()
    prepared_media: ClassVar[None] = None
    can_recompute: ClassVar[bool] = True

    @property
    def num_generated(self) -> int:
        return self.generated

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.generated

    @property
    def reservation(self) -> int:
        """What decode admission holds for it: the prompt and the first token (as DecodeHandle.kv_reservation)."""
        return self.prompt_len + 1


@dataclass(eq=False)
class _PrefillWork:
    """A request's prompt on its prefill instance (a PromptWork, as the worker's PrefillJob)."""

    request: _Request
    token_ids: _Tokens
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0
    started: bool = False
    cached_tokens: int = 0
    extra_positions: ClassVar[int] = 0  # its KV leaves with the handoff: nothing grows on a prefill instance
    media: ClassVar[tuple] = ()  # text prompts: hashed as their tokens
    prepared_media: ClassVar[None] = None
    lora: ClassVar[None] = None  # the base model
    prompt_logprobs: ClassVar[None] = None

    @property
    def cache_token_ids(self) -> _Tokens:
        return self.token_ids


@dataclass(eq=False)
class _PrefillInstance:
    pool: BlockPool
    scheduler: PrefillScheduler
    busy: bool = False
    outstanding_tokens: int = 0
    busy_s: float = 0.0


@dataclass(eq=False)
class _DecodeInstance:
    pool: BlockPool
    scheduler: DecodeScheduler
    recomputes: PrefillScheduler  # preempted sequences, recomputed in chunks beside the decode steps
    budget: KvBudget | None  # None: not limiting
    stepping: bool = False
    outstanding: int = 0
    admission: deque = field(default_factory=deque)
    busy_s: float = 0.0
    batch_seconds: float = 0.0  # sum of batch size x step time: mean batch = this / busy_s

    def preempted(self, request: _Request) -> None:
        self.recomputes.add(Recompute(request))


@dataclass(frozen=True)
class SimulationResult:
    timings: list[RequestTiming]  # in the workload's order
    prefill_utilisation: float  # share of the time the prefill instances spent in forwards
    decode_utilisation: float  # share of the time the decode instances spent in steps
    mean_decode_batch: float  # sequences per step, over the steps run
    preemptions: int = 0  # running sequences the decode instances preempted (and recomputed)


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
        self.prefills = [self._prefill_instance() for _ in range(cluster.num_prefill)]
        self.decodes = [self._decode_instance() for _ in range(cluster.num_decode)]
        self.router = _Router(cluster.policy)
        self._events: list = []
        self._order = itertools.count()
        self.now = 0.0

    def _prefill_instance(self) -> _PrefillInstance:
        settings = self.cluster.settings
        pool = _UnlimitedPool(settings.block_size)
        return _PrefillInstance(pool, PrefillScheduler(pool, settings.max_prefill_tokens,
                                                       settings.max_prefill_batch_size))

    def _decode_instance(self) -> _DecodeInstance:
        settings = self.cluster.settings
        capacity = self.cluster.decode_kv_capacity_tokens
        if capacity:
            # A worker's capacity is its pool's, whole blocks; one that is not (a profile made by hand) is rounded
            # up, so that whatever the budget admits fits the pool.
            pool = BlockPool(1 + -(-capacity // settings.block_size), settings.block_size)
        else:
            pool = _UnlimitedPool(settings.block_size)
        return _DecodeInstance(pool, DecodeScheduler(pool, settings.max_running),
                               PrefillScheduler(pool, settings.max_prefill_tokens, settings.max_prefill_batch_size),
                               KvBudget(capacity) if capacity else None)

    def _at(self, when: float, action: Callable, *args) -> None:
        heapq.heappush(self._events, (when, next(self._order), action, args))

    def run(self) -> SimulationResult:
        capacity = self.cluster.decode_kv_capacity_tokens
        requests: list[_Request] = []
        for index, trace in enumerate(self.workload.requests):
            if capacity and trace.prompt_tokens + trace.output_tokens > capacity:
                raise SimulationError(f"a request of {trace.prompt_tokens} prompt + {trace.output_tokens} output "
                                      f"tokens never fits a decode worker's KV budget ({capacity} tokens)")
            self._at(trace.arrival_s, self._arrive, index, trace, requests)
        while self._events:
            self.now, _, action, args = heapq.heappop(self._events)
            action(*args)
        stuck = [r for r in requests if r.generated < r.output_tokens]
        if stuck:
            first = stuck[0]
            raise SimulationStalled(
                f"the decode workers' scheduler stalled with {len(stuck)} requests unfinished (the first, request "
                f"{first.index} of {first.prompt_len} prompt + {first.output_tokens} output tokens, had "
                f"{first.generated}): sequences waiting to join held the blocks the first of them needed")
        start = self.workload.requests[0].arrival_s
        elapsed = max(max(r.last_token_s for r in requests) - start, 1e-9)
        decode_busy = sum(d.busy_s for d in self.decodes)
        return SimulationResult(
            timings=[RequestTiming((r.first_token_s - r.trace.arrival_s) * 1000,
                                   tpot_ms(r.first_token_s, r.last_token_s, r.output_tokens)) for r in requests],
            prefill_utilisation=sum(p.busy_s for p in self.prefills) / (len(self.prefills) * elapsed),
            decode_utilisation=decode_busy / (len(self.decodes) * elapsed),
            mean_decode_batch=sum(d.batch_seconds for d in self.decodes) / decode_busy if decode_busy else 0.0,
            preemptions=sum(d.scheduler.num_preemptions for d in self.decodes))

    # the coordinator, and decode admission -------------------------------------------------------
    def _arrive(self, index: int, trace: TraceRequest, requests: list[_Request]) -> None:
        decode = self.router.choose("decode", self.decodes, lambda d: d.outstanding)
        prefill = self.router.choose("prefill", self.prefills, lambda p: p.outstanding_tokens)
        request = _Request(index, trace, decode, prefill, trace.prompt_tokens, trace.output_tokens)
        requests.append(request)
        decode.outstanding += 1
        if decode.admission or not self._fits(decode, request):
            decode.admission.append(request)
        else:
            self._admit(request)

    @staticmethod
    def _fits(decode: _DecodeInstance, request: _Request) -> bool:
        return decode.budget is None or decode.budget.can_allocate(request.reservation)

    def _admit(self, request: _Request) -> None:
        if request.decode.budget is not None:
            request.decode.budget.allocate(request.request_id, request.reservation)
        prefill = request.prefill
        prefill.outstanding_tokens += request.prompt_len
        prefill.scheduler.add(_PrefillWork(request, request.prompt_token_ids))
        if not prefill.busy:
            prefill.busy = True
            self._at(self.now, self._start_prefill, prefill)  # after the other arrivals of this instant, as a wake-up

    def _release(self, request: _Request) -> None:
        """The request ended: its budget is freed and whoever now fits is admitted, in order."""
        decode = request.decode
        decode.outstanding -= 1
        if decode.budget is not None:
            decode.budget.free(request.request_id)
        while decode.admission and self._fits(decode, decode.admission[0]):
            self._admit(decode.admission.popleft())

    # a prefill instance ----------------------------------------------------------------------------
    def _start_prefill(self, prefill: _PrefillInstance) -> None:
        chunks = prefill.scheduler.next_chunks()
        prefill.busy = bool(chunks)
        if chunks:
            duration = self.cluster.prefill.prefill_ms(sum(c.num_tokens for c in chunks)) / 1000
            prefill.busy_s += duration
            self._at(self.now + duration, self._prefill_done, prefill, chunks)

    def _prefill_done(self, prefill: _PrefillInstance, chunks: list[Chunk]) -> None:
        for work in prefill.scheduler.computed(chunks):
            handoff_s = self.cluster.prefill.handoff_ms(work.request.prompt_len) / 1000
            self._at(self.now + handoff_s, self._kv_arrived, work)
        self._start_prefill(prefill)

    # a decode instance -----------------------------------------------------------------------------
    def _kv_arrived(self, work: _PrefillWork) -> None:
        request = work.request
        prefill = request.prefill
        prefill.pool.release(work.table)  # the decode side has the cache: the lease ends
        prefill.outstanding_tokens -= request.prompt_len
        request.first_token_s = request.last_token_s = self.now
        request.generated = 1
        decode = request.decode
        if request.generated >= request.output_tokens:
            decode.scheduler.finish(request)
            self._release(request)
            return
        decode.scheduler.add(request)
        if not decode.stepping:
            decode.stepping = True
            self._at(self.now, self._start_step, decode)  # caches arriving this same instant join the same step

    def _start_step(self, decode: _DecodeInstance) -> None:
        joined, batch = decode.scheduler.schedule(decode.preempted)
        for request in joined:
            if request.num_computed < request.prompt_len:  # its cache arrived: now in its blocks
                request.num_computed = request.prompt_len
                decode.pool.register(request.table, request.prompt_token_ids, request.prompt_len)
        chunks = decode.recomputes.next_chunks()
        decode.stepping = bool(batch or chunks)
        if not decode.stepping:  # idle until a cache arrives; anyone still waiting here is stuck (run() says so)
            return
        duration = 0.0
        if batch:
            context = sum(r.prompt_len + r.generated for r in batch)
            duration += self.cluster.decode.step_ms(len(batch), context) / 1000
        if chunks:  # the same model's forward over the recomputed tokens, timed by the prefill profile
            duration += self.cluster.prefill.prefill_ms(sum(c.num_tokens for c in chunks)) / 1000
        decode.busy_s += duration
        decode.batch_seconds += len(batch) * duration
        self._at(self.now + duration, self._step_done, decode, batch, chunks)

    def _step_done(self, decode: _DecodeInstance, batch: list[_Request], chunks: list[Chunk]) -> None:
        block_size = decode.pool.block_size
        now = self.now
        for request in batch:
            computed = request.num_computed = request.prompt_len + request.generated  # the step fed its last token
            request.generated += 1
            request.last_token_s = now
            if request.generated >= request.output_tokens:
                decode.scheduler.finish(request)
                self._release(request)
            elif computed >= (len(request.table.hashes) + 1) * block_size:  # it filled a block
                decode.pool.register(request.table, request.token_ids, computed)
        for work in decode.recomputes.computed(chunks):
            decode.scheduler.add(work.seq)
        self._start_step(decode)


def simulate(cluster: ClusterModel, workload: Workload) -> SimulationResult:
    return ClusterSimulation(cluster, workload).run()
