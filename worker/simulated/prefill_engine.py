"""The simulated prefill engine: the real admission, block pool and chunking, forwards timed by a cost model."""

from __future__ import annotations

import asyncio
import time

from worker.engine.block_pool import BlockPool
from worker.engine.messages import KvLayerReady, PrefillDone
from worker.engine.prefill_backend import KvLayout, PrefillBackend, PrefillJob
from worker.engine.scheduler import Chunk
from worker.simulated.cost_model import SIMULATED_MODEL, CostModel, KvShape
from worker.simulated.engine_task import EngineTask, RunsOnEventLoop, sleep_until
from worker.simulated.refusals import RefusesTokenConstraints
from worker.simulated.kv import synthetic_layer
from worker.simulated.tokens import synthetic_token, token_key


class SimulatedPrefillEngine(RunsOnEventLoop, RefusesTokenConstraints, PrefillBackend):
    """Chunked prefill as the real PrefillEngine schedules it, over the same block pool and prefix cache; a forward
    costs only the tokens it computes, and a prompt's layer i is out at (i+1)/L of its last chunk's forward."""

    model_name = SIMULATED_MODEL

    def __init__(self, cost: CostModel, kv_shape: KvShape, pool: BlockPool, max_batch_tokens: int = 2048,
                 max_batch_size: int = 16, vocab_size: int = 32000):
        super().__init__(pool, max_batch_tokens, max_batch_size)
        self.cost = cost
        self.kv_shape = kv_shape
        self.vocab_size = vocab_size
        self._task = EngineTask(self._run)

    def kv_layout(self, job: PrefillJob) -> KvLayout:
        shape = self.kv_shape
        return KvLayout(shape.dtype, shape.num_layers, tuple(shape.tensor_shape(job.num_sent_tokens)))

    def _enqueue(self, job: PrefillJob) -> None:
        self.scheduler.add(job)
        self._task.wake()

    def _dequeue(self, job: PrefillJob) -> None:
        self.scheduler.remove(job)

    async def _run(self) -> None:
        while True:
            if not self.scheduler.queue:
                await self._task.wait_for_work()
            chunks = self._next_chunks()
            if not chunks:
                await asyncio.sleep(0.005)  # the head waits for blocks that a lease ending will free
                continue
            self.num_running = len(chunks)
            try:
                await self._forward(chunks)
            finally:
                self.num_running = 0

    async def _forward(self, chunks: list[Chunk]) -> None:
        started = time.perf_counter()
        duration_s = (self.cost.prefill_ms(sum(c.num_tokens for c in chunks))
                      + self.cost.tier_load_ms(self.pool.take_tier_loads())) / 1000
        last = [c.work for c in chunks if c.last]
        num_layers = self.kv_shape.num_layers
        layer_bytes = [self.kv_shape.tensor_bytes(job.num_sent_tokens) for job in last]
        for i in range(num_layers):
            await sleep_until(started + duration_s * (i + 1) / num_layers)
            for job, nbytes in zip(last, layer_bytes):
                self._post(job, KvLayerReady(synthetic_layer(i, nbytes)))
        self._forward_done(chunks)
        done_at = time.perf_counter()
        self.metrics.observe_step("prefill", done_at - started, len(chunks))
        for job in last:
            first = synthetic_token(token_key(job.request_id, job.sampling.seed), 0, self.vocab_size)
            self._post(job, PrefillDone(first, (done_at - job.submitted_at) * 1000,
                                        forward_ms=(done_at - started) * 1000, done_at=done_at,
                                        cached_tokens=job.cached_tokens))
