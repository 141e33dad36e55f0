"""The real decode engine: continuous batching on its own thread, fed by KV arrivals or local prefills."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

from guidance.compiler import grammar_failure
from kv_transfer.base import KvTransferError, TransferredKv
from kv_transfer.buffer_pool import KvBufferPool
from kv_transfer.codec import KvAssembler
from worker.engine.decode_backend import DecodeBackend
from worker.engine.errors import InvalidRequest, RequestFailed
from worker.engine.grammar_masks import Guidance
from worker.engine.messages import AddSequence, CancelSequence, DecodeCommand, LocalPrefill, QueueLocalPrefill, Stop
from worker.engine.model_runner import ModelRunner
from worker.engine.output import OutputProcessor
from worker.engine.sampling import choose_batch
from worker.engine.sequence import DecodeState, SamplingParams, Sequence, TokenLogprobs, TokenOutput

logger = logging.getLogger(__name__)


class DecodeEngine(DecodeBackend):
    """Continuous batching on its own thread, fed by KV arrivals or local prefills, read by gRPC streams."""

    kv_assembler = KvAssembler

    def __init__(self, runner: ModelRunner, budget_tokens: int, max_running: int = 64,
                 max_prefill_tokens: int = 8192, max_prefill_batch_size: int = 16):
        # The scheduler and the local prefill queue are touched only by the engine thread.
        super().__init__(budget_tokens, max_running, max_prefill_tokens, max_prefill_batch_size)
        self.runner = runner
        self.model_name = str(runner.model_dir)
        self.kv_pool = KvBufferPool()
        self.guidance = Guidance(runner.tokenizer, runner.vocab_size, runner.eos_token_ids)
        self._processors: dict[str, OutputProcessor] = {}
        self._outbox: list[tuple[str, TokenOutput]] = []  # tokens for the next hand-off to the event loop
        self._inbox: queue.SimpleQueue[DecodeCommand] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)

    # asyncio side ------------------------------------------------------------------------
    def check_sampling(self, sampling: SamplingParams) -> None:
        self.guidance.check(sampling)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def shutdown(self) -> None:
        self._stopped.set()
        self._inbox.put(Stop())
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _decode_arrived(self, seq: Sequence, kv: TransferredKv) -> None:
        seq.pending_kv = kv
        self._inbox.put(AddSequence(seq))

    def _queue_local_prefill(self, job: LocalPrefill) -> None:
        self._inbox.put(QueueLocalPrefill(job))

    def _cancel(self, request_id: str) -> None:
        self._inbox.put(CancelSequence(request_id))

    # engine thread -----------------------------------------------------------------------
    def _emit(self, request_id: str, item: TokenOutput) -> None:
        """Queue a token for the next `_flush`."""
        self._outbox.append((request_id, item))

    def _flush(self) -> None:
        """Hand every queued token to the event loop in one call: a step wakes the loop once, not once per row."""
        if self._outbox:
            items, self._outbox = self._outbox, []
            self._loop.call_soon_threadsafe(self._deliver_all, items)

    def _fail_soon(self, request_id: str, message: str, error: type[Exception]) -> None:
        self._flush()  # tokens queued before the failure reach their streams before it, as they were emitted
        self._loop.call_soon_threadsafe(self.fail, request_id, message, error)

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                command = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            match command:
                case AddSequence(seq):
                    self._admit(seq)
                case QueueLocalPrefill(job):
                    self.local_prefills.add(job)
                case CancelSequence(request_id):
                    seq = self.scheduler.find(request_id)
                    if seq is not None:
                        self._retire(seq, DecodeState.CANCELLED)
                        logger.info("cancelled request %s after %d tokens", request_id, seq.num_generated)
                case Stop():
                    return

    def _admit(self, seq: Sequence) -> None:
        kv = seq.pending_kv
        if seq.sampling.grammar is not None and seq.matcher is None and not self._attach_matcher(seq, kv):
            return
        processor = OutputProcessor(seq, self.runner.tokenizer, self.runner.eos_token_ids)
        first_logprobs = None
        if seq.sampling.return_logprobs and kv.first_logprobs is not None:
            first_logprobs = TokenLogprobs(kv.first_logprobs[0], tuple(kv.first_logprobs[1]))
        output = processor.append(kv.first_token_id, kv.prefill_time_ms, first_logprobs)
        seq.last_step_at = time.perf_counter()
        if output.finish_reason is None:
            seq.status = DecodeState.DECODING  # before the batch sees it, so it is never counted twice
            self._processors[seq.request_id] = processor
            self.scheduler.add(seq)
        else:
            seq.status = DecodeState.FINISHED
            kv.release()
            seq.pending_kv = None
        self._emit(seq.request_id, output)

    def _attach_matcher(self, seq: Sequence, kv: TransferredKv) -> bool:
        """Give a sequence whose KV arrived its matcher over every token generated so far (the replayed ones,
        then the prefill worker's first), so a request moved here stays inside its grammar; False: failed."""
        try:
            seq.matcher = self.guidance.matcher(seq.sampling)
        except InvalidRequest as exc:
            self._refuse(seq, str(exc), InvalidRequest)
            return False
        if not seq.matcher.consume_token(kv.first_token_id):
            # The prefill worker ignored the grammar: its result is at fault, as a corrupt cache would be.
            self._refuse(seq, f"the first token {kv.first_token_id} from the prefill worker does not follow "
                              "the request's grammar", KvTransferError)
            return False
        return True

    def _refuse(self, seq: Sequence, message: str, error: type[Exception]) -> None:
        """End a sequence that never joined the batch."""
        seq.status = DecodeState.FAILED
        seq.matcher = None
        if seq.pending_kv is not None:
            seq.pending_kv.release()
            seq.pending_kv = None
        self._fail_soon(seq.request_id, message, error)

    def _retire(self, seq: Sequence, status: DecodeState, leave_batch: bool = True) -> None:
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
                self._flush()  # the first tokens of caches that just arrived go out before the next forward
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
            finally:
                self._flush()

    def _prefill_locally(self, jobs: list[LocalPrefill]) -> None:
        # A request released while queued is not worth a forward.
        jobs = [job for job in jobs
                if job.seq.status is DecodeState.PREFILLING_LOCALLY and self._with_matcher(job.seq)]
        if not jobs:
            return
        try:
            started = time.perf_counter()
            logits, rows = self.runner.prefill([job.seq.prompt_token_ids for job in jobs])
            self.metrics.observe_step("prefill", time.perf_counter() - started, len(jobs))
            # The first token is masked like every later one; its matcher then holds it, for `_admit`.
            picks = choose_batch(logits, [job.seq for job in jobs], self.runner.eos_token_ids, self.guidance.masks)
            arrived = []
            for row, (job, pick) in enumerate(zip(jobs, picks)):
                if pick is None:
                    self._fail_soon(job.seq.request_id, grammar_failure(job.seq.matcher), InvalidRequest)
                    arrived.append(None)
                    continue
                first, logprobs = pick
                prefill_ms = (time.perf_counter() - job.submitted_at) * 1000
                arrived.append(TransferredKv(job.seq.request_id, rows[row], first, prefill_ms,
                                             (logprobs.logprob, logprobs.top) if logprobs else None))
        except Exception as exc:  # a failed prefill fails its requests, never the engine thread
            logger.exception("local prefill of %d prompts failed", len(jobs))
            for job in jobs:
                self._fail_soon(job.seq.request_id, f"local prefill failed on the worker: {exc}", RequestFailed)
            return
        # From here on a local prefill is a sequence whose KV has just arrived (unless released meanwhile).
        for job, kv in zip(jobs, arrived):
            if kv is None or job.seq.status is not DecodeState.PREFILLING_LOCALLY:
                continue
            job.seq.pending_kv = kv
            self._admit(job.seq)
        self._flush()  # the batch's first tokens in one hand-off

    def _with_matcher(self, seq: Sequence) -> bool:
        """Give a sequence about to be prefilled here its grammar's matcher (if it has a grammar); False: failed."""
        try:
            seq.matcher = self.guidance.matcher(seq.sampling)
        except InvalidRequest as exc:
            self._fail_soon(seq.request_id, str(exc), InvalidRequest)  # the event loop moves it to FAILED
            return False
        return True

    def _fail_all(self, batch: list[Sequence]) -> None:
        # The batch may be inconsistent after a failed step: drop it whole instead of row by row.
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting) + batch:
            if not seq.is_finished:
                self._retire(seq, DecodeState.FAILED, leave_batch=False)
                # This worker failed, not the KV it was sent: the coordinator blames it and moves the request.
                self._fail_soon(seq.request_id, "decode step failed on the worker", RequestFailed)
        self.runner.reset_batch()

    def _step(self, batch: list[Sequence]) -> None:
        started = time.perf_counter()
        logits = self.runner.decode(batch)
        now = time.perf_counter()
        self.metrics.observe_step("decode", now - started, len(batch))
        picks = choose_batch(logits, batch, self.runner.eos_token_ids, self.guidance.masks)
        for seq, pick in zip(batch, picks):
            if pick is None:
                self._fail_soon(seq.request_id, grammar_failure(seq.matcher), InvalidRequest)
                self._retire(seq, DecodeState.FAILED)
                continue
            token, logprobs = pick
            output = self._processors[seq.request_id].append(
                token, (now - seq.last_step_at) * 1000, logprobs, batch_size=len(batch),
                queue_wait_ms=max(0.0, started - seq.last_step_at) * 1000)
            seq.last_step_at = now
            self._emit(seq.request_id, output)
            if output.finish_reason is not None:
                self._retire(seq, DecodeState.FINISHED)
        self._flush()

