"""Engines without a model: the real workers' admission, batching and life cycle, timed by a cost model.

Both run on the event loop (no threads): a forward is a sleep until the cost model says it ends.
Tokens are synthetic and deterministic: a hash of the request's seed (else its id) and the
token's index, so the prefill worker's first token and the decode worker's later ones agree.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import xxhash

from kv_transfer.base import KvTransferError
from proto import worker_pb2 as pb
from worker.cost_model import CostModel
from worker.kv_budget import KvAdmission, KvBudget
from worker.scheduler import DecodeScheduler, PrefillScheduler
from worker.sequence import SamplingParams, Sequence, SequenceStatus
from worker.simulated_kv import VerifiedKv

logger = logging.getLogger(__name__)


def synthetic_token(key: str, index: int, vocab_size: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{key}:{index}".encode()) % vocab_size


def token_text(token_id: int) -> str:
    return f" t{token_id}"


def token_key(request_id: str, seed: int | None) -> str:
    """What a request's tokens derive from: its seed when it has one (reproducible), else its id."""
    return f"seed={seed}" if seed is not None else request_id


def _report_crash(task: asyncio.Task) -> None:
    # An engine loop that dies would hang every request quietly; say so loudly instead.
    if not task.cancelled() and task.exception() is not None:
        logger.error("simulated engine loop stopped", exc_info=task.exception())


async def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    await asyncio.sleep(delay if delay > 0 else 0)


@dataclass(eq=False)
class SimPrefillJob:
    """One prompt on the simulated prefill worker, from admission to the end of its KV lease."""

    request_id: str
    num_tokens: int
    key: str
    submitted_at: float
    # ("layer", i) | ("done", first_token_id, prefill_ms)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False


class SimulatedPrefillEngine:
    """Batched prefill as the real PrefillEngine schedules it; layer i is out at (i+1)/L of the forward."""

    def __init__(self, cost: CostModel, num_layers: int, budget_tokens: int, max_batch_tokens: int = 8192,
                 max_batch_size: int = 16, vocab_size: int = 32000):
        self.cost = cost
        self.num_layers = num_layers
        self.vocab_size = vocab_size
        self.admission = KvAdmission(KvBudget(budget_tokens))
        self.scheduler = PrefillScheduler(max_batch_tokens, max_batch_size)
        self.leases: dict[str, SimPrefillJob] = {}
        self.num_running = 0
        self.metrics = None  # a WorkerMetrics, when the process serves them
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def num_queued_tokens(self) -> int:
        return self.scheduler.num_queued_tokens

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())
        self._task.add_done_callback(_report_crash)

    def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def submit(self, request_id: str, num_tokens: int, key: str) -> SimPrefillJob:
        """Wait for KV budget, then queue the prompt; the caller must `release` the job."""
        if request_id in self.leases:
            raise ValueError(f"request {request_id!r} is already on this prefill worker")
        submitted_at = time.perf_counter()
        await self.admission.acquire(request_id, num_tokens)
        job = SimPrefillJob(request_id, num_tokens, key, submitted_at)
        self.leases[request_id] = job
        self.scheduler.add(job)
        self._wake.set()
        return job

    def release(self, job: SimPrefillJob) -> None:
        """End the job's lease and return its budget."""
        job.cancelled = True
        self.scheduler.remove(job)
        if self.leases.pop(job.request_id, None) is not None:
            self.admission.release(job.request_id)

    async def _run(self) -> None:
        while True:
            if not self.scheduler.queue:
                self._wake.clear()
                await self._wake.wait()
            batch = [job for job in self.scheduler.next_batch() if not job.cancelled]
            if batch:
                self.num_running = len(batch)
                try:
                    await self._prefill(batch)
                finally:
                    self.num_running = 0

    async def _prefill(self, batch: list[SimPrefillJob]) -> None:
        started = time.perf_counter()
        # Right-padded like the real batch: the forward pays for width x rows tokens.
        padded = max(job.num_tokens for job in batch) * len(batch)
        duration_s = self.cost.prefill_ms(padded) / 1000
        for i in range(self.num_layers):
            await _sleep_until(started + duration_s * (i + 1) / self.num_layers)
            for job in batch:
                if not job.cancelled:
                    job.events.put_nowait(("layer", i))
        if self.metrics is not None:
            self.metrics.observe_step("prefill", time.perf_counter() - started, len(batch))
        for job in batch:
            if not job.cancelled:
                first = synthetic_token(job.key, 0, self.vocab_size)
                job.events.put_nowait(("done", first, (time.perf_counter() - job.submitted_at) * 1000))


@dataclass(eq=False)
class SimDecodeHandle:
    """The gRPC side of one decode request: its limits and its event queue (pb.TokenEvent | Exception)."""

    request_id: str
    prompt_len: int
    max_tokens: int
    max_seq_len: int
    key: str
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    kv_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    admitted: bool = False
    local_prefill_at: float = 0.0

    @property
    def kv_reservation(self) -> int:
        """Positions this request may fill: the prompt plus every token it may generate."""
        return min(self.prompt_len + self.max_tokens, self.max_seq_len)

    @property
    def num_tokens(self) -> int:  # the prompt, when it waits in the local prefill queue
        return self.prompt_len

    @property
    def limit(self) -> int:
        """Tokens it generates, the first one included: max_tokens, or what fits in max_seq_len."""
        return max(1, min(self.max_tokens, self.max_seq_len - self.prompt_len))


class SimulatedDecodeEngine:
    """Continuous batching on a timer: every step, each running sequence gets one token.

    Sequences join at the next step (up to `max_running`) and leave at once when finished or
    cancelled, through the real DecodeScheduler. Local prefills run between steps, as they would
    on the real worker's one device.
    """

    def __init__(self, cost: CostModel, budget_tokens: int, max_running: int = 64, max_prefill_tokens: int = 8192,
                 max_prefill_batch_size: int = 16, vocab_size: int = 32000):
        self.cost = cost
        self.vocab_size = vocab_size
        self.admission = KvAdmission(KvBudget(budget_tokens))
        self.scheduler = DecodeScheduler(max_running=max_running)
        self.local_prefills = PrefillScheduler(max_prefill_tokens, max_prefill_batch_size)
        self.metrics = None  # a WorkerMetrics, when the process serves them
        self._handles: dict[str, SimDecodeHandle] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())
        self._task.add_done_callback(_report_crash)

    def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()

    @property
    def num_pending_kv(self) -> int:
        """Requests holding budget and waiting for their KV (those still in the budget's line are not)."""
        return sum(1 for h in self._handles.values() if h.admitted and not h.kv_arrived.is_set())

    def register(self, request_id: str, prompt_len: int, max_tokens: int, max_seq_len: int,
                 key: str) -> SimDecodeHandle:
        if request_id in self._handles:
            raise ValueError(f"request {request_id!r} is already registered on this decode worker")
        handle = SimDecodeHandle(request_id, prompt_len, max_tokens, max_seq_len, key)
        self._handles[request_id] = handle
        return handle

    async def admit(self, handle: SimDecodeHandle) -> None:
        """Wait until the KV budget holds this request (raises KvCapacityError if it never can)."""
        await self.admission.acquire(handle.request_id, handle.kv_reservation)
        handle.admitted = True

    def on_kv(self, kv: VerifiedKv) -> None:
        """Take a verified KV stream for its waiting request: emit its first token, queue it for the batch."""
        handle = self._handles.get(kv.request_id)
        if handle is None or handle.kv_arrived.is_set():
            raise KvTransferError(f"no decode request {kv.request_id!r} is waiting for a KV cache")
        if kv.seq_len != handle.prompt_len:
            raise KvTransferError(f"KV cache holds {kv.seq_len} positions but the prompt has {handle.prompt_len} tokens")
        handle.kv_arrived.set()
        self._start(handle, kv.first_token_id, kv.prefill_time_ms)

    def prefill_locally(self, handle: SimDecodeHandle) -> None:
        """No prefill worker: this worker pays the prompt's prefill between steps and emits token 0."""
        handle.kv_arrived.set()
        handle.local_prefill_at = time.perf_counter()
        self.local_prefills.add(handle)
        self._wake.set()

    def fail(self, request_id: str, message: str) -> None:
        """End a registered request with an error (e.g. its KV stream was corrupt)."""
        handle = self._handles.get(request_id)
        if handle is not None:
            handle.events.put_nowait(KvTransferError(message))
            handle.kv_arrived.set()  # the stream reports the failure now, not after kv_trans_timeout

    def release(self, request_id: str) -> None:
        """Forget a request: it leaves the batch (or the prefill queue) at once and frees its budget."""
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            self.local_prefills.remove(handle)
            seq = self.scheduler.find(request_id)
            if seq is not None:
                self.scheduler.finish(seq, SequenceStatus.CANCELLED)
        self.admission.release(request_id)

    def _start(self, handle: SimDecodeHandle, first_token_id: int, prefill_ms: float) -> None:
        seq = Sequence(handle.request_id, handle.prompt_len, SamplingParams(max_tokens=handle.limit),
                       handle.max_seq_len)
        seq.output_token_ids.append(first_token_id)
        seq.last_step_at = time.perf_counter()
        finished = handle.limit <= 1
        handle.events.put_nowait(self._event(seq, first_token_id, prefill_ms, finished, 1, 0.0))
        if not finished:
            self.scheduler.add(seq)
            self._wake.set()

    def _event(self, seq: Sequence, token_id: int, time_ms: float, finished: bool, batch_size: int,
               queue_wait_ms: float) -> pb.TokenEvent:
        return pb.TokenEvent(
            token_id=token_id, text=token_text(token_id), time_ms=time_ms, index=seq.num_generated - 1,
            finish_reason=pb.FINISH_REASON_LENGTH if finished else pb.FINISH_REASON_UNSPECIFIED,
            batch_size=batch_size, queue_wait_ms=queue_wait_ms,
        )

    async def _run(self) -> None:
        while True:
            if not self.scheduler.running and not self.scheduler.waiting and not self.local_prefills.queue:
                self._wake.clear()
                await self._wake.wait()
            if self.local_prefills.queue:
                await self._prefill(self.local_prefills.next_batch())
            _, batch = self.scheduler.schedule()
            if batch:
                await self._step(batch)

    async def _prefill(self, batch: list[SimDecodeHandle]) -> None:
        started = time.perf_counter()
        await _sleep_until(started + self.cost.prefill_ms(max(h.prompt_len for h in batch) * len(batch)) / 1000)
        if self.metrics is not None:
            self.metrics.observe_step("prefill", time.perf_counter() - started, len(batch))
        for handle in batch:
            if self._handles.get(handle.request_id) is handle:  # not cancelled meanwhile
                first = synthetic_token(handle.key, 0, self.vocab_size)
                self._start(handle, first, (time.perf_counter() - handle.local_prefill_at) * 1000)

    async def _step(self, batch: list[Sequence]) -> None:
        started = time.perf_counter()
        await _sleep_until(started + self.cost.step_ms(len(batch)) / 1000)
        now = time.perf_counter()
        if self.metrics is not None:
            self.metrics.observe_step("decode", now - started, len(batch))
        for seq in batch:
            handle = self._handles.get(seq.request_id)
            if seq.is_finished or handle is None:  # cancelled during the step
                continue
            token = synthetic_token(handle.key, seq.num_generated, self.vocab_size)
            seq.output_token_ids.append(token)
            finished = seq.num_generated >= handle.limit
            handle.events.put_nowait(self._event(seq, token, (now - seq.last_step_at) * 1000, finished, len(batch),
                                                 max(0.0, started - seq.last_step_at) * 1000))
            seq.last_step_at = now
            if finished:
                self.scheduler.finish(seq)
