"""What the prefill servicer needs of an engine, and the admission, block and lease bookkeeping every backend shares."""

from __future__ import annotations

import abc
import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from worker.engine.block_pool import BlockPool, BlockTable
from worker.engine.errors import DuplicateRequestError, InvalidRequest
from worker.engine.kv_budget import KvAdmission, KvBudget
from worker.engine.load import WorkerLoad
from kv_events.block_hash import lora_cache_tokens
from kv_transfer.embeddings import EmbeddingsShape
from worker.engine.lora import LoadedLora, LoraResidency
from worker.engine.media import MediaSpan, cache_token_ids, refuse_media
from worker.engine.messages import PrefillEvent
from worker.engine.scheduler import Chunk, PrefillScheduler
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
    # Leading positions the decode worker already holds: computed here (attention needs them) but not sent.
    skip_tokens: int = 0
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0  # positions with KV in `table`; cached hits count
    started: bool = False
    cached_tokens: int = 0  # of the prompt, found in the prefix cache
    extra_positions: ClassVar[int] = 0  # its KV leaves with the stream: nothing grows here
    media: tuple[MediaSpan, ...] = ()  # the prompt's images, encoded as their positions are computed
    prepared_media: Any = None  # what `prepare_media` made of them
    cache_token_ids: list[int] = field(default_factory=list)  # the prompt as the prefix cache hashes it
    lora: LoadedLora | None = None  # the adapter its forwards run under (pinned until `release`); None: the base
    # Each prompt token's TokenLogprobs (with its rank) after the first, filled chunk by chunk when asked.
    prompt_logprob_entries: list = field(default_factory=list)

    def __post_init__(self):
        self.cache_token_ids = lora_cache_tokens(cache_token_ids(self.prompt_token_ids, self.media),
                                                 self.lora.ref.digest if self.lora else None)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids

    @property
    def prompt_logprobs(self) -> int | None:
        return self.sampling.prompt_logprobs

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_sent_tokens(self) -> int:
        return self.num_tokens - self.skip_tokens


class PrefillBackend(abc.ABC):
    """A prefill engine: admits prompts under a KV budget, prefills them in chunks over the block pool, and emits
    each job's KV stream.

    Subclasses run the forwards (`start`/`shutdown`, `_enqueue`/`_dequeue`) and name the stream's
    layout (`kv_layout`); a job's layers and its result arrive on `job.events`. A job's blocks stay
    in use until its lease ends, then stay cached for later prompts.
    """

    model_name: str

    def __init__(self, pool: BlockPool, max_batch_tokens: int, max_batch_size: int):
        self.pool = pool
        self.admission = KvAdmission(KvBudget(pool.capacity_tokens))
        self.scheduler = PrefillScheduler(pool, max_batch_tokens, max_batch_size)
        self.leases: dict[str, PrefillJob] = {}
        self.num_running = 0
        self.metrics = NULL_METRICS  # a WorkerMetrics, when the process serves them
        self.loras: LoraResidency | None = None  # the adapters it serves; None: none (a request naming one is refused)
        # A released job's blocks are given back by whoever holds it: the engine, while its forward runs.
        self._blocks_lock = threading.Lock()
        self._in_forward: set[PrefillJob] = set()

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

    def prepare_media(self, media: tuple[MediaSpan, ...], pulled: dict | None = None) -> Any:
        """What the forwards need of `media` (decoded and preprocessed images, and the encoder outputs `pulled`
        from encode workers or held here, by content hash); InvalidRequest unless this backend's model can take
        them (each item decodes and fits its span). Called off the event loop; a text model takes none."""
        refuse_media(media, self.model_name)
        return None

    def embeddings_wanted(self, media: tuple[MediaSpan, ...]
                          ) -> tuple[list[tuple[MediaSpan, EmbeddingsShape]], dict]:
        """The items naming an encode worker whose output this worker does not hold, each with the shape its model
        takes (what to pull), and the outputs it holds for the others (opaque to the caller, for `prepare_media`);
        InvalidRequest for a model that takes no media."""
        refuse_media(media, self.model_name)
        return [], {}

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

    async def submit(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                     skip_tokens: int = 0, media: tuple[MediaSpan, ...] = (), prepared_media: Any = None,
                     lora: LoadedLora | None = None) -> PrefillJob:
        """Wait for KV budget, then queue the prompt; the caller must `release` the job. `skip_tokens`: leading
        positions the decode worker holds (less than the prompt), computed here but not sent; `media`: its images,
        and what `prepare_media` made of them; `lora`: the adapter it runs under, pinned by the caller and unpinned
        by `release`."""
        if request_id in self.leases:
            raise DuplicateRequestError(f"request {request_id!r} is already on this prefill worker")
        if not 0 <= skip_tokens < len(prompt_token_ids):
            raise InvalidRequest(f"decode_cached_tokens={skip_tokens} must be in [0, {len(prompt_token_ids)}) for a "
                                 f"prompt of {len(prompt_token_ids)} tokens")
        submitted_at = time.perf_counter()
        reserve = self.pool.blocks_for(len(prompt_token_ids)) * self.pool.block_size
        await self.admission.acquire(request_id, reserve)
        job = PrefillJob(request_id, prompt_token_ids, sampling, submitted_at, skip_tokens=skip_tokens, media=media,
                         prepared_media=prepared_media, lora=lora)
        self.leases[request_id] = job
        self._enqueue(job)
        return job

    def release(self, job: PrefillJob) -> None:
        """End the job's lease: its blocks go back to the pool (full ones stay cached) and its budget is returned."""
        job.cancelled = True
        self._dequeue(job)
        with self._blocks_lock:
            if job not in self._in_forward:
                self.pool.release(job.table)
        if self.leases.pop(job.request_id, None) is not None:
            self.admission.release(job.request_id)
            if self.loras is not None:
                self.loras.release(job.lora)

    def _next_chunks(self) -> list[Chunk]:
        """The next forward's chunks (the engine calls this with its queue guarded); marks them in flight."""
        with self._blocks_lock:
            chunks = [c for c in self.scheduler.next_chunks() if not c.work.cancelled]
            for chunk in chunks:
                self._in_forward.add(chunk.work)
            return chunks

    def _forward_done(self, chunks: list[Chunk]) -> list[PrefillJob]:
        """Record a forward's chunks; return the jobs it completed. Jobs released meanwhile give their blocks back."""
        with self._blocks_lock:
            live = [c for c in chunks if not c.work.cancelled]
            for chunk in chunks:
                self._in_forward.discard(chunk.work)
                if chunk.work.cancelled:
                    self.scheduler.remove(chunk.work)
                    self.pool.release(chunk.work.table)
            return self.scheduler.computed(live)

    def _forward_failed(self, chunks: list[Chunk]) -> None:
        """Chunks that failed (or were refused before the forward): their jobs leave the queue and their blocks (of
        unknown contents) are freed; the lease's release finds nothing more to free."""
        with self._blocks_lock:
            for chunk in chunks:
                self._in_forward.discard(chunk.work)
                self.scheduler.remove(chunk.work)
                self.pool.release(chunk.work.table)

    def load(self) -> WorkerLoad:
        budget = self.admission.budget
        return WorkerLoad(
            role="prefill", model=self.model_name, num_running=self.num_running,
            num_waiting=self.admission.num_waiting + len(self.scheduler.queue),
            kv_capacity_tokens=budget.capacity, kv_used_tokens=budget.used, num_kv_leases=len(self.leases),
            queued_prompt_tokens=self.num_queued_tokens, pool=self.pool.stats(), loras=self.loras,
        )

    def _post(self, job: PrefillJob, event: PrefillEvent) -> None:
        """Hand an event to the job's stream (on the event loop); a released job gets nothing more."""
        if not job.cancelled:
            job.events.put_nowait(event)
