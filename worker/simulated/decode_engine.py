"""The simulated decode engine: the real admission, batching and life cycle, steps timed by a cost model."""

from __future__ import annotations

import time

from worker.engine.decode_backend import DecodeBackend
from worker.engine.messages import LocalPrefill
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

    Sequences join at the next step (up to `max_running`) and leave at once when finished or
    cancelled, through the real DecodeScheduler. Local prefills run between steps, as they would
    on the real worker's one device.
    """

    model_name = SIMULATED_MODEL
    kv_assembler = VerifyOnlyKvAssembler  # verifies every block, keeps only the stream's size

    def __init__(self, cost: CostModel, budget_tokens: int, max_running: int = 64, max_prefill_tokens: int = 8192,
                 max_prefill_batch_size: int = 16, vocab_size: int = 32000):
        super().__init__(budget_tokens, max_running, max_prefill_tokens, max_prefill_batch_size)
        self.cost = cost
        self.vocab_size = vocab_size
        self._task = EngineTask(self._run)

    def _decode_arrived(self, seq: Sequence, kv: VerifiedKv) -> None:
        self._start(seq, kv.first_token_id, kv.prefill_time_ms)

    def _queue_local_prefill(self, job: LocalPrefill) -> None:
        self.local_prefills.add(job)
        self._task.wake()

    def _cancel(self, request_id: str) -> None:
        seq = self.scheduler.find(request_id)
        if seq is not None:
            self.scheduler.finish(seq, DecodeState.CANCELLED)

    def _start(self, seq: Sequence, first_token_id: int, prefill_ms: float) -> None:
        """Emit the first token and queue the sequence for the batch, unless that token was its last."""
        seq.output_token_ids.append(first_token_id)
        seq.last_step_at = time.perf_counter()
        finished = token_limit(seq) <= 1
        seq.status = DecodeState.FINISHED if finished else DecodeState.DECODING
        if not finished:
            self.scheduler.add(seq)
            self._task.wake()
        self._deliver(seq.request_id, self._output(seq, first_token_id, prefill_ms, finished, 1, 0.0))

    def _output(self, seq: Sequence, token_id: int, time_ms: float, finished: bool, batch_size: int,
                queue_wait_ms: float) -> TokenOutput:
        return TokenOutput(token_id, token_text(token_id), time_ms, seq.num_generated - 1,
                           StopCause.LENGTH if finished else None, None, None, batch_size, queue_wait_ms)

    async def _run(self) -> None:
        while True:
            if not self.scheduler.running and not self.scheduler.waiting and not self.local_prefills.queue:
                await self._task.wait_for_work()
            if self.local_prefills.queue:
                await self._prefill(self.local_prefills.next_batch())
            _, batch = self.scheduler.schedule()
            if batch:
                await self._step(batch)

    async def _prefill(self, jobs: list[LocalPrefill]) -> None:
        # A request released while queued is not worth a forward.
        jobs = [job for job in jobs if job.seq.status is DecodeState.PREFILLING_LOCALLY]
        if not jobs:
            return
        started = time.perf_counter()
        await sleep_until(started + self.cost.prefill_ms(max(job.num_tokens for job in jobs) * len(jobs)) / 1000)
        self.metrics.observe_step("prefill", time.perf_counter() - started, len(jobs))
        for job in jobs:
            seq = job.seq
            if seq.status is DecodeState.PREFILLING_LOCALLY:  # not released during the forward
                first = synthetic_token(token_key(seq.request_id, seq.sampling.seed), 0, self.vocab_size)
                self._start(seq, first, (time.perf_counter() - job.submitted_at) * 1000)

    async def _step(self, batch: list[Sequence]) -> None:
        started = time.perf_counter()
        await sleep_until(started + self.cost.step_ms(len(batch)) / 1000)
        now = time.perf_counter()
        self.metrics.observe_step("decode", now - started, len(batch))
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
