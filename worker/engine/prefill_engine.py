"""The real prefill engine: batched forwards on a dedicated thread, each layer's KV handed out as it is made."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import torch

from guidance.compiler import grammar_failure
from kv_transfer.codec import DTYPE_NAMES, KvLayer
from worker.engine.errors import InvalidRequest
from worker.engine.grammar_masks import Guidance
from worker.engine.messages import KvLayerReady, PrefillDone, PrefillEvent, PrefillFailed
from worker.engine.model_runner import ModelRunner
from worker.engine.prefill_backend import KvLayout, PrefillBackend, PrefillJob
from worker.engine.sampling import choose_batch
from worker.engine.sequence import SamplingParams

logger = logging.getLogger(__name__)


class PrefillEngine(PrefillBackend):
    """Batched prefill on a dedicated thread, behind a KV budget with leases."""

    def __init__(self, runner: ModelRunner, budget_tokens: int, max_batch_tokens: int = 8192,
                 max_batch_size: int = 16):
        super().__init__(budget_tokens, max_batch_tokens, max_batch_size)
        self.runner = runner
        self.model_name = str(runner.model_dir)
        self.guidance = Guidance(runner.tokenizer, runner.vocab_size, runner.eos_token_ids)
        self._cond = threading.Condition()  # guards the scheduler's queue, shared with the engine thread
        self._stopped = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="prefill-engine", daemon=True)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def check_sampling(self, sampling: SamplingParams) -> None:
        self.guidance.check(sampling)

    def kv_layout(self, job: PrefillJob) -> KvLayout:
        # An unsupported dtype keeps its torch name, which the stream header refuses.
        dtype_name = DTYPE_NAMES.get(self.runner.dtype, str(self.runner.dtype))
        return KvLayout(dtype_name, self.runner.num_layers, tuple(self.runner.kv_shape(job.num_tokens)))

    @property
    def num_queued_tokens(self) -> int:
        with self._cond:
            return self.scheduler.num_queued_tokens

    def _enqueue(self, job: PrefillJob) -> None:
        with self._cond:
            self.scheduler.add(job)
            self._cond.notify()

    def _dequeue(self, job: PrefillJob) -> None:
        with self._cond:
            self.scheduler.remove(job)

    # engine thread -----------------------------------------------------------------------
    def _emit(self, job: PrefillJob, event: PrefillEvent) -> None:
        if not job.cancelled:
            self._loop.call_soon_threadsafe(self._post, job, event)

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
        batch = [job for job in batch if self._with_matcher(job)]
        if not batch:
            return
        lengths = [job.num_tokens for job in batch]

        def on_layer(i: int, keys: torch.Tensor, values: torch.Tensor) -> None:
            for row, (job, n) in enumerate(zip(batch, lengths)):
                self._emit(job, KvLayerReady(KvLayer(i, keys[row : row + 1, :, :n], values[row : row + 1, :, :n])))

        try:
            started = time.perf_counter()
            logits, _ = self.runner.prefill([job.prompt_token_ids for job in batch], on_layer)
            self.metrics.observe_step("prefill", time.perf_counter() - started, len(batch))
            # The first token is masked to the grammar, from where the replayed tokens left it.
            picks = choose_batch(logits, batch, self.runner.eos_token_ids, self.guidance.masks)
            done_at = time.perf_counter()
            for job, pick in zip(batch, picks):
                if pick is None:
                    self._emit(job, PrefillFailed(grammar_failure(job.matcher), invalid=True))
                else:
                    self._emit(job, PrefillDone(pick[0], (done_at - job.submitted_at) * 1000, pick[1],
                                                forward_ms=(done_at - started) * 1000, done_at=done_at))
                job.matcher = None
        except Exception as exc:  # a failed forward must fail its requests, not hang them
            logger.exception("prefill of %d prompts failed", len(batch))
            for job in batch:
                self._emit(job, PrefillFailed(f"prefill failed on the worker: {exc}"))

    def _with_matcher(self, job: PrefillJob) -> bool:
        """Give a job its grammar's matcher (if it has a grammar); False: failed (checked before, so rare)."""
        try:
            job.matcher = self.guidance.matcher(job.sampling)
        except InvalidRequest as exc:
            self._emit(job, PrefillFailed(str(exc), invalid=True))
            return False
        return True
