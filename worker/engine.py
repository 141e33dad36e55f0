"""The engines behind the gRPC servers.

Prefill worker, one request's life:
  1. `PrefillEngine.prefill` queues the prompt on the engine thread (one forward at a time).
  2. The forward fills the KV cache; the first token is sampled from the last position.
  3. The server pushes the KV cache to the decode worker named in the request and answers
     the coordinator once the decode worker has verified and acknowledged every byte.

Decode worker, one request's life:
  1. `DecodeEngine.register` is called when the coordinator opens the Decode stream; the
     request waits for its KV cache (bounded by the receive timeout).
  2. `DecodeEngine.on_kv` receives the verified cache from the prefill worker; the sequence is
     handed to the engine thread, which emits the prefill worker's first token at once.
  3. Every engine step runs one decode forward for the running sequences, samples a token
     each, and posts the tokens to their streams; a finished or cancelled sequence leaves the
     scheduler at once and drops its cache.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kv_transfer.base import KvTransferError, TransferredKv
from worker.model_runner import ModelRunner
from worker.output import OutputProcessor
from worker.sampling import sample_token
from worker.scheduler import DecodeScheduler
from worker.sequence import SamplingParams, Sequence, SequenceStatus, TokenOutput

logger = logging.getLogger(__name__)


class PrefillEngine:
    """Runs prompts one forward at a time on a dedicated thread."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill")
        self.num_queued = 0

    async def prefill(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> TransferredKv:
        """Compute the prompt's KV cache and sample the first token."""
        self.num_queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, self._prefill_sync, request_id, prompt_token_ids, sampling
            )
        finally:
            self.num_queued -= 1

    def _prefill_sync(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> TransferredKv:
        start = time.perf_counter()
        logits, layers = self.runner.prefill(prompt_token_ids)
        first = sample_token(logits, sampling, index=0)
        elapsed_ms = (time.perf_counter() - start) * 1000
        return TransferredKv(request_id=request_id, layers=layers, first_token_id=first, prefill_time_ms=elapsed_ms)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


@dataclass
class DecodeHandle:
    """The asyncio side of one decode request: its parameters and its event queue."""

    request_id: str
    prompt_len: int
    sampling: SamplingParams
    max_seq_len: int
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    kv_arrived: asyncio.Event = field(default_factory=asyncio.Event)


class DecodeEngine:
    """Continuous decode loop on its own thread, fed by KV arrivals, read by gRPC streams."""

    def __init__(self, runner: ModelRunner, max_running: int = 256):
        self.runner = runner
        self.scheduler = DecodeScheduler(max_running=max_running)
        self._handles: dict[str, DecodeHandle] = {}
        self._processors: dict[str, OutputProcessor] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)

    # asyncio side ------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    @property
    def num_pending(self) -> int:
        return sum(1 for h in self._handles.values() if not h.kv_arrived.is_set())

    def register(self, request_id: str, prompt_len: int, sampling: SamplingParams, max_seq_len: int) -> DecodeHandle:
        if request_id in self._handles:
            raise ValueError(f"request {request_id!r} is already registered on this decode worker")
        handle = DecodeHandle(request_id, prompt_len, sampling, max_seq_len)
        self._handles[request_id] = handle
        return handle

    def on_kv(self, kv: TransferredKv) -> None:
        """Hand a verified KV cache to its waiting request; raise if nobody waits for it."""
        handle = self._handles.get(kv.request_id)
        if handle is None or handle.kv_arrived.is_set():
            raise KvTransferError(f"no decode request {kv.request_id!r} is waiting for a KV cache")
        if kv.seq_len != handle.prompt_len:
            raise KvTransferError(f"KV cache holds {kv.seq_len} positions but the prompt has {handle.prompt_len} tokens")
        seq = Sequence(kv.request_id, handle.prompt_len, handle.sampling, handle.max_seq_len)
        self.runner.attach_kv(seq, kv.layers)
        handle.kv_arrived.set()
        self._inbox.put(("add", seq, kv))

    def fail(self, request_id: str, message: str) -> None:
        """End a registered request with an error (e.g. its KV stream was corrupt)."""
        handle = self._handles.get(request_id)
        if handle is not None:
            handle.events.put_nowait(KvTransferError(message))

    def release(self, request_id: str) -> None:
        """Forget a request; if it is still decoding, cancel it and free its cache."""
        if self._handles.pop(request_id, None) is not None:
            self._inbox.put(("cancel", request_id, None))

    def shutdown(self) -> None:
        self._stopped.set()
        self._inbox.put(("stop", None, None))

    # engine thread -----------------------------------------------------------------------
    def _post(self, request_id: str, output: TokenOutput) -> None:
        handle = self._handles.get(request_id)
        if handle is not None:
            handle.events.put_nowait(output)

    def _emit(self, request_id: str, output: TokenOutput) -> None:
        self._loop.call_soon_threadsafe(self._post, request_id, output)

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                kind, item, extra = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                self._admit(item, extra)
            elif kind == "cancel":
                seq = self.scheduler.find(item)
                if seq is not None:
                    self._retire(seq, SequenceStatus.CANCELLED)
                    logger.info("cancelled request %s after %d tokens", item, seq.num_generated)

    def _admit(self, seq: Sequence, kv: TransferredKv) -> None:
        processor = OutputProcessor(seq, self.runner.tokenizer, self.runner.eos_token_ids)
        self._processors[seq.request_id] = processor
        output = processor.append(kv.first_token_id, kv.prefill_time_ms)
        seq.last_step_at = time.perf_counter()
        self._emit(seq.request_id, output)
        if output.finish_reason is None:
            self.scheduler.add(seq)
        else:
            self._processors.pop(seq.request_id, None)

    def _retire(self, seq: Sequence, status: SequenceStatus) -> None:
        self.scheduler.finish(seq, status)
        self._processors.pop(seq.request_id, None)

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._drain_inbox(block=not self.scheduler.running and not self.scheduler.waiting)
            seqs = self.scheduler.schedule()
            if not seqs:
                continue
            try:
                self._step(seqs)
            except Exception:  # a model failure must end the affected streams, not hang them
                logger.exception("decode step failed")
                for seq in seqs:
                    self._retire(seq, SequenceStatus.CANCELLED)
                    self._loop.call_soon_threadsafe(self.fail, seq.request_id, "decode step failed on the worker")

    def _step(self, seqs: list[Sequence]) -> None:
        all_logits = self.runner.decode(seqs)
        now = time.perf_counter()
        for seq, logits in zip(seqs, all_logits):
            token = sample_token(logits, seq.sampling, index=seq.num_generated)
            output = self._processors[seq.request_id].append(token, (now - seq.last_step_at) * 1000)
            seq.last_step_at = now
            self._emit(seq.request_id, output)
            if output.finish_reason is not None:
                self._retire(seq, SequenceStatus.FINISHED)
