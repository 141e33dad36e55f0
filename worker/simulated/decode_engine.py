"""The simulated decode engine: the real admission, batching and life cycle, steps timed by a cost model."""

from __future__ import annotations

import asyncio
import time

from worker.engine.decode_backend import DecodeBackend
from worker.engine.block_pool import BlockPool
from worker.engine.messages import LocalPrefill, Recompute
from worker.engine.scheduler import Chunk
from worker.engine.sequence import DecodeState, Sequence, StopCause, TokenOutput
from worker.simulated.cost_model import SIMULATED_MODEL, CostModel
from worker.simulated.engine_task import EngineTask, RunsOnEventLoop, sleep_until
from worker.simulated.refusals import RefusesTokenConstraints
from worker.simulated.kv import VerifiedKv, VerifyOnlyKvAssembler
from worker.simulated.tokens import synthetic_token, token_key, token_text


def token_limit(seq: Sequence) -> int:
    """Tokens it generates, the first one included: max_tokens, or what fits in max_seq_len."""
    return max(1, min(seq.sampling.max_tokens, seq.max_seq_len - seq.prompt_len))


class SimulatedDecodeEngine(RunsOnEventLoop, RefusesTokenConstraints, DecodeBackend):
    """Continuous batching on a timer: every step, each running sequence gets one token.

    The real DecodeScheduler and block pool decide who runs, who joins and who is preempted; local
    prefills and recomputations share steps with decoding in chunks, as on the real worker, and a
    step costs its decode rows plus the prompt tokens it computes (cached ones are free).
    """

    model_name = SIMULATED_MODEL
    kv_assembler = VerifyOnlyKvAssembler  # verifies every block, keeps only the stream's size

    def __init__(self, cost: CostModel, pool: BlockPool, max_running: int = 64, max_prefill_tokens: int = 2048,
                 max_prefill_batch_size: int = 16, vocab_size: int = 32000):
        super().__init__(pool, max_running, max_prefill_tokens, max_prefill_batch_size)
        self.cost = cost
        self.vocab_size = vocab_size
        self._task = EngineTask(self._run)

    def _decode_arrived(self, seq: Sequence, kv: VerifiedKv) -> None:
        self._reuse_cached_blocks(seq, kv.first_position)
        self._start(seq, kv.first_token_id, kv.prefill_time_ms)

    def _queue_local_prefill(self, job: LocalPrefill) -> None:
        self.local_prefills.add(job)
        self._task.wake()

    def _cancel(self, request_id: str) -> None:
        seq = self.scheduler.find(request_id)
        if seq is None:
            work = next((w for w in self.local_prefills.queue if w.seq.request_id == request_id), None)
            if work is None:
                return
            self.local_prefills.remove(work)
            seq = work.seq
        self.scheduler.finish(seq, DecodeState.CANCELLED)

    def _start(self, seq: Sequence, first_token_id: int, prefill_ms: float) -> None:
        """Emit the first token and queue the sequence for the batch, unless that token was its last."""
        seq.output_token_ids.append(first_token_id)
        seq.last_step_at = time.perf_counter()
        finished = token_limit(seq) <= 1
        if finished:
            self.scheduler.finish(seq)
        else:
            seq.status = DecodeState.DECODING
            self.scheduler.add(seq)
            self._task.wake()
        self._deliver(seq.request_id, self._output(seq, first_token_id, prefill_ms, finished, 1, 0.0))

    def _output(self, seq: Sequence, token_id: int, time_ms: float, finished: bool, batch_size: int,
                queue_wait_ms: float) -> TokenOutput:
        return TokenOutput(token_id, token_text(token_id), time_ms, seq.num_generated - 1,
                           StopCause.LENGTH if finished else None, None, None, batch_size, queue_wait_ms)

    def _preempted(self, seq: Sequence) -> None:
        self.local_prefills.add_first(Recompute(seq))

    async def _run(self) -> None:
        while True:
            if not self.scheduler.running and not self.scheduler.waiting and not self.local_prefills.queue:
                await self._task.wait_for_work()
            joined, batch = self.scheduler.schedule(self._preempted)
            for seq in joined:
                if seq.num_computed < seq.prompt_len:  # its cache arrived: now in its blocks
                    seq.num_computed = seq.prompt_len
                    if seq.prompt_token_ids:
                        self.pool.register(seq.table, seq.prompt_cache_ids, seq.prompt_len)
            chunks = self.local_prefills.next_chunks()
            if not batch and not chunks:
                await asyncio.sleep(0.005)  # waiting for blocks that only a release can free
                continue
            await self._step(batch, chunks)

    async def _step(self, batch: list[Sequence], chunks: list[Chunk]) -> None:
        started = time.perf_counter()
        prompt_tokens = sum(c.num_tokens for c in chunks)
        cost_ms = ((self.cost.step_ms(len(batch)) if batch else 0.0) + (self.cost.prefill_ms(prompt_tokens) if chunks else 0.0)
                   + self.cost.tier_load_ms(self.pool.take_tier_loads()))
        await sleep_until(started + cost_ms / 1000)
        now = time.perf_counter()
        self._stepped([seq for seq in batch if not seq.is_finished], len(chunks), started, now)
        for seq in batch:
            if seq.is_finished:  # cancelled during the step
                continue
            token = synthetic_token(token_key(seq.request_id, seq.sampling.seed), seq.num_generated, self.vocab_size)
            seq.output_token_ids.append(token)
            finished = seq.num_generated >= token_limit(seq)
            self._deliver(seq.request_id, self._output(seq, token, (now - seq.last_step_at) * 1000, finished,
                                                       len(batch), max(0.0, started - seq.last_step_at) * 1000))
            seq.last_step_at = now
            if finished:
                self.scheduler.finish(seq)
            else:
                self._register_output_blocks(seq)
        for work in self.local_prefills.computed([c for c in chunks if not c.work.seq.is_finished]):
            seq = work.seq
            if isinstance(work, Recompute):
                self.scheduler.add(seq)
            elif seq.status is DecodeState.PREFILLING_LOCALLY:  # not released during the forward
                first = synthetic_token(token_key(seq.request_id, seq.sampling.seed), 0, self.vocab_size)
                self._start(seq, first, (time.perf_counter() - work.submitted_at) * 1000)
