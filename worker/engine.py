"""The engines behind the gRPC servers.

Prefill worker, one request's life:
  1. `PrefillEngine.submit` waits in line until the KV budget can hold the prompt (the lease
     starts here), then queues the prompt for the engine thread.
  2. The engine thread prefills queued prompts together, right-padded, within the token and
     batch-size budgets; each layer's KV is handed out as soon as that layer has run.
  3. The server streams header, layers and trailer (first token, timing) to the decode worker.
  4. `PrefillEngine.release` ends the lease when the decode worker confirms receipt, when the
     lease expires, or when the request is cancelled, whichever comes first.

Decode worker, one request's life:
  1. `DecodeEngine.register` + `admit`: the coordinator's Decode stream waits in line until the
     KV budget can hold prompt + max tokens, then is told `accepted`.
  2. Either `DecodeEngine.on_kv` receives the verified cache from a prefill worker, and the
     engine thread emits that worker's first token at once; or (local prefill, no prefill worker)
     `DecodeEngine.prefill_locally` queues the prompt, and the engine thread prefills queued
     prompts together between decode steps and samples and emits the first token itself, exactly
     as a prefill worker would. Either way the sequence is then queued for the batch.
  3. Every step runs one batched forward over all running sequences; a sequence joins at the
     next step and a finished or cancelled one leaves at once, freeing its rows.
  4. `DecodeEngine.release` (end of the stream, for any reason) frees the budget.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from kv_transfer.base import KvTransferError, TransferredKv
from worker.kv_budget import KvAdmission, KvBudget
from worker.model_runner import ModelRunner
from worker.output import OutputProcessor
from worker.sampling import choose
from worker.scheduler import DecodeScheduler, PrefillScheduler
from worker.sequence import SamplingParams, Sequence, SequenceStatus, TokenLogprobs, TokenOutput

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PrefillJob:
    """One prompt on the prefill worker, from admission to the end of its KV lease."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    submitted_at: float
    # ("layer", i, key, value) | ("done", first_token_id, prefill_ms, logprobs) | ("error", message)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


class PrefillEngine:
    """Batched prefill on a dedicated thread, behind a KV budget with leases."""

    def __init__(self, runner: ModelRunner, budget_tokens: int, max_batch_tokens: int = 8192,
                 max_batch_size: int = 16):
        self.runner = runner
        self.admission = KvAdmission(KvBudget(budget_tokens))
        self.scheduler = PrefillScheduler(max_batch_tokens, max_batch_size)
        self.leases: dict[str, PrefillJob] = {}
        self.num_running = 0
        self.metrics = None  # a WorkerMetrics, when the process serves them
        self._cond = threading.Condition()
        self._stopped = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="prefill-engine", daemon=True)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    @property
    def num_queued_tokens(self) -> int:
        with self._cond:
            return self.scheduler.num_queued_tokens

    async def submit(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> PrefillJob:
        """Wait for KV budget, then queue the prompt; the caller must `release` the job."""
        if request_id in self.leases:
            raise ValueError(f"request {request_id!r} is already on this prefill worker")
        submitted_at = time.perf_counter()
        await self.admission.acquire(request_id, len(prompt_token_ids))
        job = PrefillJob(request_id, prompt_token_ids, sampling, submitted_at)
        self.leases[request_id] = job
        with self._cond:
            self.scheduler.add(job)
            self._cond.notify()
        return job

    def release(self, job: PrefillJob) -> None:
        """End the job's lease: its KV is dropped and its budget returned."""
        job.cancelled = True
        with self._cond:
            self.scheduler.remove(job)
        if self.leases.pop(job.request_id, None) is not None:
            self.admission.release(job.request_id)

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _emit(self, job: PrefillJob, item: tuple) -> None:
        if not job.cancelled:
            self._loop.call_soon_threadsafe(job.events.put_nowait, item)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and not self.scheduler.queue:
                    self._cond.wait()
                if self._stopped:
                    return
                batch = [job for job in self.scheduler.next_batch() if not job.cancelled]
                self.num_running = len(batch)
            if batch:
                self._prefill(batch)
            self.num_running = 0

    def _prefill(self, batch: list[PrefillJob]) -> None:
        lengths = [job.num_tokens for job in batch]

        def on_layer(i: int, keys: torch.Tensor, values: torch.Tensor) -> None:
            for row, (job, n) in enumerate(zip(batch, lengths)):
                self._emit(job, ("layer", i, keys[row : row + 1, :, :n], values[row : row + 1, :, :n]))

        try:
            started = time.perf_counter()
            logits, _ = self.runner.prefill([job.prompt_token_ids for job in batch], on_layer)
            if self.metrics is not None:
                self.metrics.observe_step("prefill", time.perf_counter() - started, len(batch))
            for row, job in enumerate(batch):
                first, logprobs = choose(logits[row], job.sampling, job.prompt_token_ids, [],
                                         self.runner.eos_token_ids)
                self._emit(job, ("done", first, (time.perf_counter() - job.submitted_at) * 1000, logprobs))
        except Exception as exc:  # a failed forward must fail its requests, not hang them
            logger.exception("prefill of %d prompts failed", len(batch))
            for job in batch:
                self._emit(job, ("error", f"prefill failed on the worker: {exc}"))


@dataclass
class DecodeHandle:
    """The asyncio side of one decode request: its parameters and its event queue."""

    request_id: str
    prompt_len: int
    sampling: SamplingParams
    max_seq_len: int
    prompt_token_ids: list[int] = field(default_factory=list)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    kv_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    # A local prefill's first-token time counts from here, admission wait included, as on a prefill worker.
    registered_at: float = field(default_factory=time.perf_counter)

    @property
    def kv_reservation(self) -> int:
        """Positions this request may fill: the prompt plus every token it may generate."""
        return min(self.prompt_len + self.sampling.max_tokens, self.max_seq_len)


@dataclass(eq=False)
class LocalPrefill:
    """A prompt the decode worker prefills itself (conditional disaggregation)."""

    seq: Sequence
    submitted_at: float

    @property
    def num_tokens(self) -> int:
        return self.seq.prompt_len


class DecodeEngine:
    """Continuous batching on its own thread, fed by KV arrivals or local prefills, read by gRPC streams."""

    def __init__(self, runner: ModelRunner, budget_tokens: int, max_running: int = 64,
                 max_prefill_tokens: int = 8192, max_prefill_batch_size: int = 16):
        self.runner = runner
        self.admission = KvAdmission(KvBudget(budget_tokens))
        self.scheduler = DecodeScheduler(max_running=max_running)
        # Touched only by the engine thread: local prefills wait here between decode steps.
        self.local_prefills = PrefillScheduler(max_prefill_tokens, max_prefill_batch_size)
        self.metrics = None  # a WorkerMetrics, when the process serves them
        self._handles: dict[str, DecodeHandle] = {}
        self._processors: dict[str, OutputProcessor] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)

    # asyncio side ------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    @property
    def num_pending_kv(self) -> int:
        return sum(1 for h in self._handles.values() if not h.kv_arrived.is_set())

    def register(self, request_id: str, prompt_len: int, sampling: SamplingParams, max_seq_len: int,
                 prompt_token_ids: list[int] | None = None) -> DecodeHandle:
        if request_id in self._handles:
            raise ValueError(f"request {request_id!r} is already registered on this decode worker")
        handle = DecodeHandle(request_id, prompt_len, sampling, max_seq_len, list(prompt_token_ids or []))
        self._handles[request_id] = handle
        return handle

    async def admit(self, handle: DecodeHandle) -> None:
        """Wait until the KV budget holds this request (raises KvCapacityError if it never can)."""
        await self.admission.acquire(handle.request_id, handle.kv_reservation)

    def on_kv(self, kv: TransferredKv) -> None:
        """Hand a verified KV cache to its waiting request; raise if nobody waits for it."""
        handle = self._handles.get(kv.request_id)
        if handle is None or handle.kv_arrived.is_set():
            raise KvTransferError(f"no decode request {kv.request_id!r} is waiting for a KV cache")
        if kv.seq_len != handle.prompt_len:
            raise KvTransferError(f"KV cache holds {kv.seq_len} positions but the prompt has {handle.prompt_len} tokens")
        seq = Sequence(kv.request_id, handle.prompt_len, handle.sampling, handle.max_seq_len,
                       prompt_token_ids=handle.prompt_token_ids)
        seq.pending_kv = kv
        handle.kv_arrived.set()
        self._inbox.put(("add", seq, kv))

    def prefill_locally(self, handle: DecodeHandle) -> None:
        """Queue an admitted request's prompt for prefill on the engine thread (no prefill worker)."""
        if len(handle.prompt_token_ids) != handle.prompt_len:
            raise ValueError(f"local prefill needs the whole prompt: {len(handle.prompt_token_ids)} "
                             f"prompt_token_ids for prompt_len={handle.prompt_len}")
        seq = Sequence(handle.request_id, handle.prompt_len, handle.sampling, handle.max_seq_len,
                       prompt_token_ids=handle.prompt_token_ids)
        handle.kv_arrived.set()  # its cache is made here, so nothing is awaited from a transfer
        self._inbox.put(("prefill", LocalPrefill(seq, handle.registered_at), None))

    def fail(self, request_id: str, message: str, error: type[Exception] = KvTransferError) -> None:
        """End a registered request with an error (e.g. its KV stream was corrupt)."""
        handle = self._handles.get(request_id)
        if handle is not None:
            handle.events.put_nowait(error(message))

    def release(self, request_id: str) -> None:
        """Forget a request: cancel it if it still decodes, and free its KV budget."""
        if self._handles.pop(request_id, None) is not None:
            self._inbox.put(("cancel", request_id, None))
        self.admission.release(request_id)

    def shutdown(self) -> None:
        self._stopped.set()
        self._inbox.put(("stop", None, None))
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    # engine thread -----------------------------------------------------------------------
    def _post(self, request_id: str, output: TokenOutput) -> None:
        handle = self._handles.get(request_id)
        if handle is not None:
            handle.events.put_nowait(output)

    def _emit(self, request_id: str, output: TokenOutput) -> None:
        self._loop.call_soon_threadsafe(self._post, request_id, output)

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                kind, item, extra = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                self._admit(item, extra)
            elif kind == "prefill":
                self.local_prefills.add(item)
            elif kind == "cancel":
                seq = self.scheduler.find(item)
                if seq is not None:
                    self._retire(seq, SequenceStatus.CANCELLED)
                    logger.info("cancelled request %s after %d tokens", item, seq.num_generated)

    def _admit(self, seq: Sequence, kv: TransferredKv) -> None:
        processor = OutputProcessor(seq, self.runner.tokenizer, self.runner.eos_token_ids)
        first_logprobs = None
        if seq.sampling.return_logprobs and kv.first_logprobs is not None:
            first_logprobs = TokenLogprobs(kv.first_logprobs[0], tuple(kv.first_logprobs[1]))
        output = processor.append(kv.first_token_id, kv.prefill_time_ms, first_logprobs)
        seq.last_step_at = time.perf_counter()
        self._emit(seq.request_id, output)
        if output.finish_reason is None:
            self._processors[seq.request_id] = processor
            self.scheduler.add(seq)
        else:
            kv.release()
            seq.pending_kv = None

    def _retire(self, seq: Sequence, status: SequenceStatus, leave_batch: bool = True) -> None:
        self.scheduler.finish(seq, status)
        if leave_batch:
            self.runner.leave(seq.request_id)
        if seq.pending_kv is not None:
            seq.pending_kv.release()
            seq.pending_kv = None
        self._processors.pop(seq.request_id, None)

    def _run(self) -> None:
        while not self._stopped.is_set():
            batch: list[Sequence] = []
            try:
                idle = not self.scheduler.running and not self.scheduler.waiting and not self.local_prefills.queue
                self._drain_inbox(block=idle)
                # One prefill forward per turn, between decode steps, so running sequences keep moving.
                self._prefill_locally(self.local_prefills.next_batch())
                joined, batch = self.scheduler.schedule()
                if not batch:
                    continue
                for seq in joined:
                    # The batch copies the rows in; the transferred buffers go back to the pool.
                    self.runner.join(seq, seq.pending_kv.layers)
                    seq.pending_kv.release()
                    seq.pending_kv = None
                self._step(batch)
            except Exception:  # a failure must end the affected streams, never the engine thread
                logger.exception("decode step failed; failing its %d sequences", len(batch))
                self._fail_all(batch)

    def _prefill_locally(self, jobs: list[LocalPrefill]) -> None:
        # A request released while queued is not worth a forward; `_handles` only shrinks under us.
        jobs = [job for job in jobs if job.seq.request_id in self._handles]
        if not jobs:
            return
        try:
            started = time.perf_counter()
            logits, rows = self.runner.prefill([job.seq.prompt_token_ids for job in jobs])
            if self.metrics is not None:
                self.metrics.observe_step("prefill", time.perf_counter() - started, len(jobs))
            arrived = []
            for row, job in enumerate(jobs):
                seq = job.seq
                first, logprobs = choose(logits[row], seq.sampling, seq.prompt_token_ids, [],
                                         self.runner.eos_token_ids)
                prefill_ms = (time.perf_counter() - job.submitted_at) * 1000
                arrived.append(TransferredKv(seq.request_id, rows[row], first, prefill_ms,
                                             (logprobs.logprob, logprobs.top) if logprobs else None))
        except Exception as exc:  # a failed prefill fails its requests, never the engine thread
            logger.exception("local prefill of %d prompts failed", len(jobs))
            for job in jobs:
                self._loop.call_soon_threadsafe(self.fail, job.seq.request_id,
                                                f"local prefill failed on the worker: {exc}", RuntimeError)
            return
        # From here on a local prefill is a sequence whose KV has just arrived.
        for job, kv in zip(jobs, arrived):
            job.seq.pending_kv = kv
            self._admit(job.seq, kv)

    def _fail_all(self, batch: list[Sequence]) -> None:
        # The batch may be inconsistent after a failed step: drop it whole instead of row by row.
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting) + batch:
            if not seq.is_finished:
                self._retire(seq, SequenceStatus.CANCELLED, leave_batch=False)
                self._loop.call_soon_threadsafe(self.fail, seq.request_id, "decode step failed on the worker")
        self.runner.reset_batch()

    def _step(self, batch: list[Sequence]) -> None:
        started = time.perf_counter()
        all_logits = self.runner.decode(batch)
        now = time.perf_counter()
        if self.metrics is not None:
            self.metrics.observe_step("decode", now - started, len(batch))
        for seq in batch:
            token, logprobs = choose(all_logits[seq.request_id], seq.sampling, seq.prompt_token_ids,
                                     seq.output_token_ids, self.runner.eos_token_ids)
            output = self._processors[seq.request_id].append(
                token, (now - seq.last_step_at) * 1000, logprobs, batch_size=len(batch),
                queue_wait_ms=max(0.0, started - seq.last_step_at) * 1000)
            seq.last_step_at = now
            self._emit(seq.request_id, output)
            if output.finish_reason is not None:
                self._retire(seq, SequenceStatus.FINISHED)
