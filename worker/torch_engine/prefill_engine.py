"""The real prefill engine: chunked forwards over the block pool on a dedicated thread; a prompt's KV is handed out
layer by layer during its last chunk's forward."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from guidance.compiler import grammar_failure
from kv_transfer.codec import DTYPE_NAMES, KvLayer
from worker.engine.errors import InvalidRequest
from worker.torch_engine.grammar_masks import Guidance
from worker.engine.block_pool import BlockPool
from worker.engine.messages import KvLayerReady, PrefillDone, PrefillEvent, PrefillFailed
from worker.torch_engine.model_runner import ModelRunner
from worker.engine.prefill_backend import KvLayout, PrefillBackend, PrefillJob
from worker.engine.scheduler import Chunk
from worker.torch_engine.sampling import choose_batch
from worker.engine.sequence import SamplingParams

logger = logging.getLogger(__name__)


class PrefillEngine(PrefillBackend):
    """Chunked prefill over the block pool on a dedicated thread, behind a KV budget with leases."""

    def __init__(self, runner: ModelRunner, pool: BlockPool, max_batch_tokens: int = 2048, max_batch_size: int = 16):
        super().__init__(pool, max_batch_tokens, max_batch_size)
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

    def prepare_media(self, media, pulled=None):
        return self.runner.prepare_media(media, pulled)

    def embeddings_wanted(self, media):
        return self.runner.embeddings_wanted(media)

    def kv_layout(self, job: PrefillJob) -> KvLayout:
        # An unsupported dtype keeps its torch name, which the stream header refuses.
        dtype_name = DTYPE_NAMES.get(self.runner.dtype, str(self.runner.dtype))
        return KvLayout(dtype_name, self.runner.num_layers, self.runner.kv_shape(job.num_sent_tokens))

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
                chunks = self._next_chunks()
                if not chunks:  # the head waits for blocks that a lease ending will free
                    self._cond.wait(timeout=0.05)
                    continue
                self.num_running = len(chunks)
            self._forward(chunks)
            self.num_running = 0

    def _forward(self, chunks: list[Chunk]) -> None:
        refused = [c for c in chunks if c.last and not self._with_matcher(c.work)]  # their failure is posted
        if refused:
            with self._cond:
                self._forward_failed(refused)
            chunks = [c for c in chunks if c not in refused]
        prompt_chunks, broken = self.runner.prompt_chunks(chunks, lambda c: c.last)
        if broken:  # their images failed to encode: those requests fail, the rest of the forward runs
            with self._cond:
                self._forward_failed([c for c, _ in broken])
            for chunk, exc in broken:
                self._emit(chunk.work, PrefillFailed(f"encoding its images failed: {exc}",
                                                     invalid=isinstance(exc, InvalidRequest)))
            chunks = [c for c in chunks if all(c is not b for b, _ in broken)]
            if not chunks:
                return
        last = [c for c in chunks if c.last]
        # Where each finishing prompt's KV to send lies, once for all its layers.
        sent = [(c.work, self.runner.kv_slots(c.work.table, c.work.skip_tokens, c.work.num_tokens)) for c in last]

        def on_layer(i: int) -> None:
            for job, slots in sent:
                key, value = self.runner.read_kv(slots, i)
                self._emit(job, KvLayerReady(KvLayer(i, key, value)))

        try:
            started = time.perf_counter()
            scored: dict[int, list] = {}
            logits = self.runner.forward([], prompt_chunks, on_layer if last else None, scored)
            for i, entries in scored.items():
                chunks[i].work.prompt_logprob_entries.extend(entries)
            self.metrics.observe_step("prefill", time.perf_counter() - started, len(chunks))
            # The first token is masked to the grammar, from where the replayed tokens left it.
            picks = choose_batch(logits, [c.work for c in last], self.runner.eos_token_ids, self.guidance.masks)
        except Exception as exc:  # a failed forward must fail its requests, not hang them
            logger.exception("prefill of %d chunks failed", len(chunks))
            with self._cond:
                self._forward_failed(chunks)
            for chunk in chunks:
                self._emit(chunk.work, PrefillFailed(f"prefill failed on the worker: {exc}"))
            return
        with self._cond:  # the scheduler's queue is shared with the event loop
            self._forward_done(chunks)
        done_at = time.perf_counter()
        for chunk, pick in zip(last, picks):
            job = chunk.work
            if pick is None:
                self._emit(job, PrefillFailed(grammar_failure(job.matcher), invalid=True))
            else:
                self._emit(job, PrefillDone(pick[0], (done_at - job.submitted_at) * 1000, pick[1],
                                            forward_ms=(done_at - started) * 1000, done_at=done_at,
                                            cached_tokens=job.cached_tokens,
                                            prompt_logprobs=job.prompt_logprob_entries
                                            if job.prompt_logprobs is not None else None))
            job.matcher = None

    def _with_matcher(self, job: PrefillJob) -> bool:
        """Give a job its grammar's matcher (if it has a grammar); False: failed (checked before, so rare)."""
        try:
            job.matcher = self.guidance.matcher(job.sampling)
        except InvalidRequest as exc:
            self._emit(job, PrefillFailed(str(exc), invalid=True))
            return False
        return True
