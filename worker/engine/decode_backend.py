"""What the decode servicer needs of an engine, and the request bookkeeping every backend shares.

A request's state (`DecodeState`) lives on its Sequence and moves one way. The event loop moves it
until it is DECODING; from then on only the engine does, so a sequence in the batch never changes
state under the engine. A local prefill the loop cancels or fails is dropped by the engine, which
checks the state before and after the forward. Health figures are counted from these states.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kv_transfer.base import KvReceipt, KvTransferError
from worker.engine.errors import DuplicateRequestError
from worker.engine.block_pool import BlockPool
from worker.engine.kv_budget import KvAdmission, KvBudget, KvCapacityError
from worker.engine.load import WorkerLoad
from worker.engine.lora import LoadedLora, LoraResidency
from worker.engine.media import MediaSpan, refuse_media
from worker.engine.messages import LocalPrefill
from worker.engine.scheduler import DecodeScheduler, PrefillScheduler
from worker.engine.sequence import DecodeState, SamplingParams, Sequence, TokenOutput
from worker.metrics import NULL_METRICS

# States the event loop moves a request out of; from DECODING on, only the engine does.
BEFORE_DECODING = frozenset({DecodeState.WAITING_FOR_BUDGET, DecodeState.WAITING_FOR_KV, DecodeState.PREFILLING_LOCALLY})


@dataclass(eq=False)
class DecodeHandle:
    """The asyncio side of one decode request: its sequence and the events its stream reads."""

    seq: Sequence
    events: asyncio.Queue[TokenOutput | Exception] = field(default_factory=asyncio.Queue)
    # Set once nothing more is awaited from a KV transfer: the cache arrived, is made here, or failed.
    kv_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    registered_at: float = field(default_factory=time.perf_counter)
    # Where its tokens go instead of `events` (a token channel); the last token goes to both, so the
    # stream learns the request ended.
    relay: Callable[[TokenOutput], None] | None = None
    # For the request's trace: how its KV cache came, and when (time.perf_counter) its first decode step's token
    # was handed over.
    kv_receipt: KvReceipt | None = None
    first_step_at: float = 0.0
    engine_has_it: bool = False  # its sequence (and block table) was handed to the engine, which frees its blocks

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def prompt_len(self) -> int:
        return self.seq.prompt_len

    @property
    def state(self) -> DecodeState:
        return self.seq.status

    @property
    def kv_reservation(self) -> int:
        """Positions admission holds for it (in whole blocks): the prompt and its first token; it takes blocks as it
        grows."""
        return self.seq.prompt_len + 1

    @property
    def kv_positions_at_most(self) -> int:
        """Positions it may fill: the prompt plus every token it may generate."""
        return min(self.seq.prompt_len + self.seq.sampling.max_tokens, self.seq.max_seq_len)


class DecodeBackend(abc.ABC):
    """A decode engine: admits requests under a KV budget, takes their caches (or prefills them), and
    decodes them in one continuous batch over the block pool.

    Admission holds each request's prompt blocks only; a running sequence takes a block whenever it
    fills one, and when the pool runs dry the youngest is preempted and recomputed later, never failed.
    Subclasses run the steps: `_decode_arrived` (a cache is here), `_queue_local_prefill`, `_cancel`.
    """

    model_name: str
    # What the KV receivers write incoming streams into (kv_transfer's `assembler`) and the buffers they lend.
    kv_assembler: Callable[..., Any] | None = None
    kv_pool: Any = None

    def __init__(self, pool: BlockPool, max_running: int, max_prefill_tokens: int, max_prefill_batch_size: int):
        self.pool = pool
        self.admission = KvAdmission(KvBudget(pool.capacity_tokens))
        self.scheduler = DecodeScheduler(pool, max_running=max_running)
        # Local prefills and preempted sequences' recomputations, in chunks between (and with) decode steps.
        self.local_prefills = PrefillScheduler(pool, max_prefill_tokens, max_prefill_batch_size)
        self.metrics = NULL_METRICS  # a WorkerMetrics, when the process serves them
        self.loras: LoraResidency | None = None  # the adapters it serves; None: none (a request naming one is refused)
        self._handles: dict[str, DecodeHandle] = {}

    @abc.abstractmethod
    def start(self) -> None:
        """Start stepping (from the running event loop)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop stepping."""

    @abc.abstractmethod
    def check_sampling(self, sampling: SamplingParams) -> None:
        """Raise InvalidRequest if this backend cannot honour `sampling`; may compile a grammar, so the
        servicer calls it off the event loop."""

    def prepare_media(self, media: tuple[MediaSpan, ...]) -> Any:
        """As PrefillBackend.prepare_media, for a local prefill here."""
        refuse_media(media, self.model_name)
        return None

    @abc.abstractmethod
    def _decode_arrived(self, seq: Sequence, kv) -> None:
        """Emit the first token the KV cache carries and queue the sequence for the batch."""

    @abc.abstractmethod
    def _queue_local_prefill(self, job: LocalPrefill) -> None:
        """Queue a prompt for prefill between decode steps."""

    @abc.abstractmethod
    def _cancel(self, request_id: str) -> None:
        """Take a released request out of the batch at once."""

    # asyncio side ------------------------------------------------------------------------
    def register(self, request_id: str, prompt_len: int, sampling: SamplingParams, max_seq_len: int,
                 prompt_token_ids: list[int] | None = None, media: tuple[MediaSpan, ...] = (),
                 prepared_media: Any = None, lora: LoadedLora | None = None) -> DecodeHandle:
        """A request's handle; `lora`: the adapter it runs under, pinned by the caller and unpinned by `release`."""
        if request_id in self._handles:
            raise DuplicateRequestError(f"request {request_id!r} is already registered on this decode worker")
        handle = DecodeHandle(Sequence(request_id, prompt_len, sampling, max_seq_len,
                                       prompt_token_ids=list(prompt_token_ids or []), media=media,
                                       prepared_media=prepared_media, lora=lora))
        self._handles[request_id] = handle
        return handle

    async def admit(self, handle: DecodeHandle) -> None:
        """Wait until the KV budget holds this request (raises KvCapacityError if it never can)."""
        try:
            if handle.kv_positions_at_most > self.pool.capacity_tokens:
                raise KvCapacityError(
                    f"request needs up to {handle.kv_positions_at_most} tokens of KV cache but this worker's whole "
                    f"pool holds {self.pool.capacity_tokens} tokens")
            await self.admission.acquire(handle.request_id, self.pool.blocks_for(handle.kv_reservation)
                                         * self.pool.block_size)
        except Exception:
            handle.seq.status = DecodeState.FAILED
            raise
        if handle.state is DecodeState.WAITING_FOR_BUDGET:
            handle.seq.status = DecodeState.WAITING_FOR_KV

    def hold_cached_prefix(self, handle: DecodeHandle) -> int:
        """Take the prompt's leading blocks that this worker's prefix cache holds into the request's table (kept
        until it ends); return the positions they cover, which its KV stream need not carry."""
        seq = handle.seq
        if len(seq.prompt_token_ids) != seq.prompt_len or seq.table.block_ids:
            return 0
        seq.num_computed = self.pool.cached_prefix(seq.prompt_cache_ids, seq.prompt_len - 1, seq.table)
        return seq.num_computed

    def _stepped(self, batch: list[Sequence], num_chunks: int, started: float, now: float) -> None:
        """A step's bookkeeping, whatever ran it: its metrics, and every decode row's KV now computed."""
        if batch:
            self.metrics.observe_step("decode", now - started, len(batch))
        if num_chunks:
            self.metrics.observe_step("prefill", now - started, num_chunks)
        for seq in batch:
            seq.num_computed = seq.total_len

    def _register_output_blocks(self, seq: Sequence) -> None:
        """Record a decoding sequence's blocks it has just filled in the prefix cache (checked cheaply per token: a
        block fills every block_size tokens; its tokens are gathered only then)."""
        if seq.prompt_token_ids and self.pool.has_unregistered_full_block(seq.table, seq.num_computed):
            self.pool.register(seq.table, seq.cache_token_ids, seq.num_computed)

    def _reuse_cached_blocks(self, seq: Sequence, first_position: int) -> None:
        """On the engine's side, as a received cache is about to be placed: take the prompt's blocks that requests
        placed since this one was accepted have left in the prefix cache (a burst of requests sharing a prompt all
        come before any has one), so those positions share blocks instead of being written again."""
        if seq.prompt_token_ids and seq.num_computed == first_position:
            seq.num_computed = self.pool.more_cached_prefix(seq.prompt_cache_ids, seq.prompt_len - 1, seq.table)

    def on_kv(self, kv) -> None:
        """Hand a verified KV cache to its waiting request; raise if nobody waits for it."""
        handle = self._handles.get(kv.request_id)
        if handle is None or handle.state is not DecodeState.WAITING_FOR_KV:
            raise KvTransferError(f"no decode request {kv.request_id!r} is waiting for a KV cache")
        if kv.first_position != handle.seq.num_computed:
            raise KvTransferError(f"KV cache starts at position {kv.first_position} but this worker holds the "
                                  f"prompt's first {handle.seq.num_computed} positions")
        if kv.first_position + kv.seq_len != handle.prompt_len:
            raise KvTransferError(f"KV cache holds positions up to {kv.first_position + kv.seq_len} but the prompt "
                                  f"has {handle.prompt_len} tokens")
        handle.seq.status = DecodeState.DECODING
        handle.kv_receipt = kv.receipt
        handle.engine_has_it = True
        handle.kv_arrived.set()
        self._decode_arrived(handle.seq, kv)

    def prefill_locally(self, handle: DecodeHandle) -> None:
        """Queue an admitted request's prompt for prefill on this worker (no prefill worker)."""
        seq = handle.seq
        if len(seq.prompt_token_ids) != seq.prompt_len:
            raise ValueError(f"local prefill needs the whole prompt: {len(seq.prompt_token_ids)} "
                             f"prompt_token_ids for prompt_len={seq.prompt_len}")
        seq.status = DecodeState.PREFILLING_LOCALLY
        handle.engine_has_it = True
        handle.kv_arrived.set()  # its cache is made here, so nothing is awaited from a transfer
        self._queue_local_prefill(LocalPrefill(seq, handle.registered_at))

    def fail(self, request_id: str, message: str, error: type[Exception] = KvTransferError) -> None:
        """End a registered request with an error (e.g. its KV stream was corrupt)."""
        handle = self._handles.get(request_id)
        if handle is not None:
            if handle.state in BEFORE_DECODING:
                handle.seq.status = DecodeState.FAILED  # once DECODING, the engine retires it
            handle.events.put_nowait(error(message))
            handle.kv_arrived.set()  # the stream reports the failure now, not after kv_trans_timeout

    def release(self, request_id: str) -> None:
        """Forget a request: it leaves the batch (or the prefill queue) at once and frees its budget."""
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            if handle.state in BEFORE_DECODING:
                handle.seq.status = DecodeState.CANCELLED  # once DECODING, the engine retires it on `_cancel`
            if not handle.engine_has_it:
                self.pool.release(handle.seq.table)  # the cached prefix it held; the engine never saw it
            self._cancel(request_id)
            if self.loras is not None:
                self.loras.release(handle.seq.lora)
        self.admission.release(request_id)

    def load(self) -> WorkerLoad:
        """Health figures: running = in the batch; waiting = for budget, for KV, for a local prefill, for a seat."""
        states = Counter(handle.state for handle in self._handles.values())
        budget = self.admission.budget
        return WorkerLoad(
            role="decode", model=self.model_name, num_running=self.scheduler.num_running,
            num_waiting=states[DecodeState.WAITING_FOR_BUDGET] + states[DecodeState.WAITING_FOR_KV]
            + states[DecodeState.PREFILLING_LOCALLY] + self.scheduler.num_waiting,
            kv_capacity_tokens=budget.capacity, kv_used_tokens=budget.used, pool=self.pool.stats(),
            num_preemptions=self.scheduler.num_preemptions, loras=self.loras,
        )

    def _deliver_all(self, items: list[tuple[str, TokenOutput | Exception]]) -> None:
        """One decode step's hand-off: each request's token (or error), in order."""
        for request_id, item in items:
            self._deliver(request_id, item)

    def _deliver(self, request_id: str, item: TokenOutput | Exception) -> None:
        """Hand a token (or an error) to the request's stream, on the event loop; a released one gets nothing."""
        handle = self._handles.get(request_id)
        if handle is None:
            return
        if not handle.first_step_at and item.__class__ is TokenOutput and item.index:
            handle.first_step_at = time.perf_counter()
        if handle.relay is not None and not isinstance(item, Exception):
            handle.relay(item)
            if item.finish_reason is None:
                return
        handle.events.put_nowait(item)
