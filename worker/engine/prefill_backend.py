"""What the prefill servicer needs of an engine, and the admission and lease bookkeeping every backend shares."""

from __future__ import annotations

import abc
import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from worker.engine.errors import DuplicateRequestError
from worker.engine.kv_budget import KvAdmission, KvBudget
from worker.engine.load import WorkerLoad
from worker.engine.messages import PrefillEvent
from worker.engine.scheduler import PrefillScheduler
from worker.engine.sequence import SamplingParams
from worker.metrics import NULL_METRICS


@dataclass(frozen=True)
class KvLayout:
    """A KV stream's header fields: the cache's dtype (its wire name), layer count and per-layer tensor shape."""

    dtype_name: str
    num_layers: int
    shape: tuple[int, ...]


@dataclass(eq=False)
class PrefillJob:
    """One prompt on the prefill worker, from admission to the end of its KV lease."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    submitted_at: float
    events: asyncio.Queue[PrefillEvent] = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    matcher: Any = None  # its grammar's matcher while the engine picks the first token; None: unconstrained
    output_token_ids: ClassVar[tuple[int, ...]] = ()  # a prefill picks the first token: none came before

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


class PrefillBackend(abc.ABC):
    """A prefill engine: admits prompts under a KV budget, batches them, and emits each job's KV stream.

    Subclasses run the forwards (`start`/`shutdown`, `_enqueue`/`_dequeue`) and name the stream's
    layout (`kv_layout`); a job's layers and its result arrive on `job.events`.
    """

    model_name: str

    def __init__(self, budget_tokens: int, max_batch_tokens: int, max_batch_size: int):
        self.admission = KvAdmission(KvBudget(budget_tokens))
        self.scheduler = PrefillScheduler(max_batch_tokens, max_batch_size)
        self.leases: dict[str, PrefillJob] = {}
        self.num_running = 0
        self.metrics = NULL_METRICS  # a WorkerMetrics, when the process serves them

    @abc.abstractmethod
    def start(self) -> None:
        """Start running forwards (on the running event loop's side of things)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop running forwards."""

    @abc.abstractmethod
    def check_sampling(self, sampling: SamplingParams) -> None:
        """Raise InvalidRequest if this backend cannot honour `sampling`; may compile a grammar, so the
        servicer calls it off the event loop."""

    @abc.abstractmethod
    def kv_layout(self, job: PrefillJob) -> KvLayout:
        """How the job's KV cache is laid out on the wire: dtype, layers and tensor shape of this backend's cache."""

    @abc.abstractmethod
    def _enqueue(self, job: PrefillJob) -> None:
        """Queue an admitted job for the next forward."""

    @abc.abstractmethod
    def _dequeue(self, job: PrefillJob) -> None:
        """Take a job out of the queue if it is still there."""

    @property
    def num_queued_tokens(self) -> int:
        return self.scheduler.num_queued_tokens

    async def submit(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> PrefillJob:
        """Wait for KV budget, then queue the prompt; the caller must `release` the job."""
        if request_id in self.leases:
            raise DuplicateRequestError(f"request {request_id!r} is already on this prefill worker")
        submitted_at = time.perf_counter()
        await self.admission.acquire(request_id, len(prompt_token_ids))
        job = PrefillJob(request_id, prompt_token_ids, sampling, submitted_at)
        self.leases[request_id] = job
        self._enqueue(job)
        return job

    def release(self, job: PrefillJob) -> None:
        """End the job's lease: its KV is dropped and its budget returned."""
        job.cancelled = True
        self._dequeue(job)
        if self.leases.pop(job.request_id, None) is not None:
            self.admission.release(job.request_id)

    def load(self) -> WorkerLoad:
        budget = self.admission.budget
        return WorkerLoad(
            role="prefill", model=self.model_name, num_running=self.num_running,
            num_waiting=self.admission.num_waiting + len(self.scheduler.queue),
            kv_capacity_tokens=budget.capacity, kv_used_tokens=budget.used, num_kv_leases=len(self.leases),
            queued_prompt_tokens=self.num_queued_tokens,
        )

    def _post(self, job: PrefillJob, event: PrefillEvent) -> None:
        """Hand an event to the job's stream (on the event loop); a released job gets nothing more."""
        if not job.cancelled:
            job.events.put_nowait(event)
