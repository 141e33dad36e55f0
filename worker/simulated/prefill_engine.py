"""The simulated prefill engine: the real admission and batching, forwards timed by a cost model."""

from __future__ import annotations

import time

from worker.engine.messages import KvLayerReady, PrefillDone
from worker.engine.prefill_backend import KvLayout, PrefillBackend, PrefillJob
from worker.simulated.cost_model import SIMULATED_MODEL, CostModel, KvShape
from worker.simulated.engine_task import EngineTask, RunsOnEventLoop, sleep_until
from worker.simulated.refusals import RefusesTokenConstraints
from worker.simulated.kv import synthetic_layer
from worker.simulated.tokens import synthetic_token, token_key


class SimulatedPrefillEngine(RunsOnEventLoop, RefusesTokenConstraints, PrefillBackend):
    """Batched prefill as the real PrefillEngine schedules it; layer i is out at (i+1)/L of the forward."""

    model_name = SIMULATED_MODEL

    def __init__(self, cost: CostModel, kv_shape: KvShape, budget_tokens: int, max_batch_tokens: int = 8192,
                 max_batch_size: int = 16, vocab_size: int = 32000):
        super().__init__(budget_tokens, max_batch_tokens, max_batch_size)
        self.cost = cost
        self.kv_shape = kv_shape
        self.vocab_size = vocab_size
        self._task = EngineTask(self._run)

    def kv_layout(self, job: PrefillJob) -> KvLayout:
        shape = self.kv_shape
        return KvLayout(shape.dtype, shape.num_layers, tuple(shape.tensor_shape(job.num_tokens)))

    def _enqueue(self, job: PrefillJob) -> None:
        self.scheduler.add(job)
        self._task.wake()

    def _dequeue(self, job: PrefillJob) -> None:
        self.scheduler.remove(job)

    async def _run(self) -> None:
        while True:
            if not self.scheduler.queue:
                await self._task.wait_for_work()
            batch = [job for job in self.scheduler.next_batch() if not job.cancelled]
            if batch:
                self.num_running = len(batch)
                try:
                    await self._prefill(batch)
                finally:
                    self.num_running = 0

    async def _prefill(self, batch: list[PrefillJob]) -> None:
        started = time.perf_counter()
        # Right-padded like the real batch: the forward pays for width x rows tokens.
        padded = max(job.num_tokens for job in batch) * len(batch)
        duration_s = self.cost.prefill_ms(padded) / 1000
        num_layers = self.kv_shape.num_layers
        layer_bytes = [self.kv_shape.tensor_bytes(job.num_tokens) for job in batch]
        for i in range(num_layers):
            await sleep_until(started + duration_s * (i + 1) / num_layers)
            for job, nbytes in zip(batch, layer_bytes):
                self._post(job, KvLayerReady(synthetic_layer(i, nbytes)))
        done_at = time.perf_counter()
        self.metrics.observe_step("prefill", done_at - started, len(batch))
        for job in batch:
            first = synthetic_token(token_key(job.request_id, job.sampling.seed), 0, self.vocab_size)
            self._post(job, PrefillDone(first, (done_at - job.submitted_at) * 1000,
                                        forward_ms=(done_at - started) * 1000, done_at=done_at))
