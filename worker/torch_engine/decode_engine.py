"""The real decode engine: continuous batching over the block pool on its own thread, fed by KV arrivals or local
prefills; each step is one forward of every running sequence's next token plus at most one budget of prompt chunks."""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time

import torch

from guidance.compiler import grammar_failure
from kv_transfer.base import KvLanding, KvTransferError, TransferredKv
from kv_transfer.buffer_pool import KvBufferPool
from kv_transfer.codec import DTYPE_NAMES, KvAssembler
from worker.engine.decode_backend import DecodeBackend
from worker.engine.errors import InvalidRequest, RequestFailed, SequencePreempted
from worker.torch_engine.grammar_masks import Guidance
from worker.engine.block_pool import BlockPool, BlockTable
from worker.engine.messages import (AddSequence, BlocksAsked, CancelSequence, DecodeCommand, LocalPrefill,
                                    QueueLocalPrefill, Recompute, ReturnBlocks, Stop, TakeBlocks)
from worker.engine.scheduler import Chunk
from worker.torch_engine.draft_verify import (drafts_given_back_on_failure, split_drafted, verified_runs,
                                              verify_chunks)
from worker.torch_engine.model_runner import DecodeRow, ModelRunner
from worker.engine.speculative.drafter import Drafter
from worker.engine.output import OutputProcessor
from worker.torch_engine.sampling import choose_batch
from worker.engine.sequence import DecodeState, SamplingParams, Sequence, TokenLogprobs, TokenOutput

logger = logging.getLogger(__name__)

# How long a KV receiver waits for the engine thread to hand it blocks (the engine answers between two steps and
# between the layers of a step) before it receives into a buffer instead.
BLOCKS_WAIT_S = 1.0


class DecodeEngine(DecodeBackend):
    """Continuous batching on its own thread, fed by KV arrivals or local prefills, read by gRPC streams."""

    def __init__(self, runner: ModelRunner, pool: BlockPool, max_running: int = 64,
                 max_prefill_tokens: int = 2048, max_prefill_batch_size: int = 16, drafter: Drafter | None = None):
        # The scheduler and the local prefill queue are touched only by the engine thread.
        super().__init__(pool, max_running, max_prefill_tokens, max_prefill_batch_size)
        self.runner = runner
        self.model_name = str(runner.model_dir)
        self.kv_pool = KvBufferPool()
        self.guidance = Guidance(runner.tokenizer, runner.vocab_size, runner.eos_token_ids)
        self.drafter = drafter  # speculative decoding's planner; None: one token per row and step
        if drafter is not None:
            drafter.vocab_size = runner.vocab_size
        self._processors: dict[str, OutputProcessor] = {}
        self._outbox: list[tuple[str, TokenOutput]] = []  # tokens for the next hand-off to the event loop
        self._inbox: queue.SimpleQueue[DecodeCommand] = queue.SimpleQueue()
        # Receivers' asks for blocks, also answered between the layers of a forward (a step can take longer than a
        # receiver should wait); the TakeBlocks in the inbox wakes an idle engine thread.
        self._asks: collections.deque[BlocksAsked] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)

    # asyncio side ------------------------------------------------------------------------
    def check_sampling(self, sampling: SamplingParams) -> None:
        self.guidance.check(sampling)

    def prepare_media(self, media):
        return self.runner.prepare_media(media)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def shutdown(self) -> None:
        self._stopped.set()
        self._inbox.put(Stop())
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _decode_arrived(self, seq: Sequence, kv: TransferredKv) -> None:
        seq.pending_kv = kv
        self._inbox.put(AddSequence(seq))

    # KV receivers' threads ---------------------------------------------------------------
    def kv_assembler(self, header, max_bytes: int | None = None, pool: KvBufferPool | None = None) -> KvAssembler:
        """What a KV stream is received into (the KV sink's `assembler`, on a receiver's thread).

        Straight into blocks of the pool, taken for it now by the engine thread (`_landing_for`): the cache is in its
        sequence's blocks when it arrives, and joining the batch copies nothing. The fallback is a pooled receive
        buffer, copied into the sequence's blocks when it joins (one `index_copy_` per layer), counted in
        `pdserve_worker_kv_receive_fallbacks_total` by reason: `no_room` (the pool cannot hold the stream now
        beside what the sequences waiting to join need), `device` (the pool is not on the CPU: its memory is not
        the host's), `engine_busy` (the engine thread did not answer within BLOCKS_WAIT_S)."""
        return KvAssembler(header, max_bytes, pool, self._landing_for)

    def _landing_for(self, header) -> KvLanding | None:
        """Pool blocks for the stream `header` starts, asked of the engine thread (whose pool it is); None: use a
        receive buffer. Raises KvTransferError for a cache this pool cannot hold (another model's)."""
        self._refuse_misfit(header)
        if self.runner.device.type != "cpu":
            self.metrics.kv_receive_fallbacks.labels("device").inc()
            return None
        ask = BlocksAsked(header.shape[0])
        self._asks.append(ask)
        self._inbox.put(TakeBlocks(ask))
        landing = ask.wait(BLOCKS_WAIT_S)
        if landing is None:
            self.metrics.kv_receive_fallbacks.labels("engine_busy" if ask.gave_up else "no_room").inc()
        return landing

    def _refuse_misfit(self, header) -> None:
        """A stream whose layers, dtype, kv heads or head size are not the pool's is refused when its header comes."""
        keys = self.runner.cache.keys
        pool = (DTYPE_NAMES.get(keys[0].dtype, str(keys[0].dtype)), len(keys), *keys[0].shape[1:])
        sent = (header.dtype, header.num_layers, *header.shape[1:])
        if sent != pool:
            raise KvTransferError("KV cache of {1} layers of {0} [positions, {2}, {3}] does not fit this worker's pool "
                                  "of {5} layers of {4} [slots, {6}, {7}]: the workers run different models or "
                                  "dtypes".format(*sent, *pool))

    def _give_back(self, block_ids: list[int]) -> None:
        """Blocks a transfer took and never handed to its sequence go back, on the engine thread (any thread)."""
        self._inbox.put(ReturnBlocks(block_ids))

    def _queue_local_prefill(self, job: LocalPrefill) -> None:
        self._inbox.put(QueueLocalPrefill(job))

    def _cancel(self, request_id: str) -> None:
        self._inbox.put(CancelSequence(request_id))

    # engine thread -----------------------------------------------------------------------
    def _emit(self, request_id: str, item: TokenOutput) -> None:
        """Queue a token for the next `_flush`."""
        self._outbox.append((request_id, item))

    def _flush(self) -> None:
        """Hand every queued token to the event loop in one call: a step wakes the loop once, not once per row."""
        if self._outbox:
            items, self._outbox = self._outbox, []
            self._loop.call_soon_threadsafe(self._deliver_all, items)

    def _fail_soon(self, request_id: str, message: str, error: type[Exception]) -> None:
        self._flush()  # tokens queued before the failure reach their streams before it, as they were emitted
        self._loop.call_soon_threadsafe(self.fail, request_id, message, error)

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                command = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            match command:
                case AddSequence(seq):
                    self._admit(seq)
                case QueueLocalPrefill(job):
                    self.local_prefills.add(job)
                case TakeBlocks():
                    self._answer_asks()
                case ReturnBlocks(block_ids):
                    self.pool.release(BlockTable(block_ids))
                case CancelSequence(request_id):
                    seq = self.scheduler.find(request_id) or self._take_prompt_work(request_id)
                    if seq is not None:
                        self._retire(seq, DecodeState.CANCELLED)
                        logger.info("cancelled request %s after %d tokens", request_id, seq.num_generated)
                case Stop():
                    return

    def _answer_asks(self, layer: int | None = None) -> None:
        """Answer the receivers waiting for blocks (between steps, and between the layers of a step: `layer`);
        blocks taken for a receiver that stopped waiting go back."""
        while self._asks:
            ask = self._asks.popleft()
            landing = self._take_blocks(ask.num_positions)
            if not ask.answer(landing) and landing is not None:
                landing.release()  # the receiver stopped waiting: it uses a receive buffer

    def _take_blocks(self, num_positions: int) -> KvLanding | None:
        """Blocks to receive `num_positions` positions straight into (blocks never used before zeroed: attention reads
        a block's unfilled tail), unless the pool cannot spare them beside what the sequences waiting to join need."""
        need = self.pool.blocks_for(num_positions)
        waiting = sum(max(0, self.pool.blocks_for(s.total_len) - s.table.num_blocks) for s in self.scheduler.waiting)
        table = BlockTable()
        if need + waiting > self.pool.num_free or not self.pool.grow(table, num_positions):
            return None
        fresh = self.pool.take_fresh()
        if fresh:
            with torch.inference_mode():
                self.runner.cache.zero_blocks(fresh)
        return KvLanding(table.block_ids, num_positions, self.runner.cache.block_runs(table.block_ids, num_positions),
                         self._give_back)

    def _admit(self, seq: Sequence) -> None:
        """A sequence whose KV arrived: emit the first token it carries and queue it to join the batch (a cache received
        into pool blocks is already in them; one in a receive buffer is written into its blocks when it joins)."""
        kv = seq.pending_kv
        if kv.landed is not None:
            self._take_landed(seq, kv)
        else:
            self._reuse_cached_blocks(seq, kv.first_position)
        if seq.sampling.grammar is not None and seq.matcher is None and not self._attach_matcher(seq, kv):
            return
        first_logprobs = None
        if seq.sampling.return_logprobs and kv.first_logprobs is not None:
            first_logprobs = TokenLogprobs(kv.first_logprobs[0], tuple(kv.first_logprobs[1]))
        self._start(seq, kv.first_token_id, kv.prefill_time_ms, first_logprobs,
                    kv.prompt_logprobs if seq.sampling.prompt_logprobs is not None else None)

    def _take_landed(self, seq: Sequence, kv: TransferredKv) -> None:
        """The blocks its cache was received into join its table after the cached prefix it holds. Those whose
        contents the prefix cache has come to hold since it was accepted (a burst sharing a prompt: another request
        placed them) are shared instead, as `_reuse_cached_blocks` shares them, and the received copies go back."""
        blocks = kv.landed.take()
        held = seq.table.num_blocks
        self._reuse_cached_blocks(seq, kv.first_position)
        shared = seq.table.num_blocks - held
        if shared:
            self.pool.release(BlockTable(blocks[:shared]))
        seq.table.block_ids.extend(blocks[shared:])

    def _start(self, seq: Sequence, first_token_id: int, prefill_ms: float, logprobs: TokenLogprobs | None,
               prompt_logprobs=None) -> None:
        processor = OutputProcessor(seq, self.runner.tokenizer, self.runner.eos_token_ids)
        output = processor.append(first_token_id, prefill_ms, logprobs)
        output.prompt_logprobs = prompt_logprobs  # the prefill worker's, relayed with the first token
        seq.last_step_at = time.perf_counter()
        if output.finish_reason is None:
            seq.status = DecodeState.DECODING  # before the batch sees it, so it is never counted twice
            self._processors[seq.request_id] = processor
            self.scheduler.add(seq)
        else:
            self._retire(seq, DecodeState.FINISHED)
        self._emit(seq.request_id, output)

    def _attach_matcher(self, seq: Sequence, kv: TransferredKv) -> bool:
        """Give a sequence whose KV arrived its matcher over every token generated so far (the replayed ones,
        then the prefill worker's first), so a request moved here stays inside its grammar; False: failed."""
        try:
            seq.matcher = self.guidance.matcher(seq.sampling)
        except InvalidRequest as exc:
            self._refuse(seq, str(exc), InvalidRequest)
            return False
        if not seq.matcher.consume_token(kv.first_token_id):
            # The prefill worker ignored the grammar: its result is at fault, as a corrupt cache would be.
            self._refuse(seq, f"the first token {kv.first_token_id} from the prefill worker does not follow "
                              "the request's grammar", KvTransferError)
            return False
        return True

    def _refuse(self, seq: Sequence, message: str, error: type[Exception]) -> None:
        """End a sequence that never joined the batch."""
        seq.matcher = None
        self._retire(seq, DecodeState.FAILED)
        self._fail_soon(seq.request_id, message, error)

    def _retire(self, seq: Sequence, status: DecodeState) -> None:
        """A sequence leaves for good: out of the batch, its blocks and any received cache given back."""
        self.scheduler.finish(seq, status)
        if seq.pending_kv is not None:
            seq.pending_kv.release()
            seq.pending_kv = None
        self._processors.pop(seq.request_id, None)

    def _take_prompt_work(self, request_id: str) -> Sequence | None:
        """Take a request's local prefill or recomputation out of the prompt queue (it is being cancelled)."""
        for work in self.local_prefills.queue:
            if work.seq.request_id == request_id:
                self.local_prefills.remove(work)
                return work.seq
        return None

    def _preempted(self, seq: Sequence) -> None:
        if seq.pending_kv is not None:  # preempted before it joined: its blocks went, and it is recomputed whole
            seq.pending_kv.release()
            seq.pending_kv = None
        if not seq.can_recompute:
            logger.info("preempted request %s after %d tokens: its images are not here, so it moves on",
                        seq.request_id, seq.num_generated)
            self._retire(seq, DecodeState.FAILED)
            self._fail_soon(seq.request_id, "preempted when the KV pool ran dry; its cache cannot be recomputed on "
                                            "this worker (its images stayed with the prefill worker)",
                            SequencePreempted)
            return
        logger.info("preempted request %s after %d tokens: recomputing it when blocks free up", seq.request_id,
                    seq.num_generated)
        self.local_prefills.add_first(Recompute(seq))

    def _run(self) -> None:
        while not self._stopped.is_set():
            batch: list[Sequence] = []
            chunks: list[Chunk] = []
            try:
                idle = not self.scheduler.running and not self.scheduler.waiting and not self.local_prefills.queue
                self._drain_inbox(block=idle)
                self._flush()  # the first tokens of caches that just arrived go out before the next forward
                joined, batch = self.scheduler.schedule(self._preempted)
                for seq in joined:
                    if seq.pending_kv is not None:
                        self._place_received(seq)
                # Prompt chunks share the step with decoding: no decode step waits for more than one chunk budget.
                chunks = self._prompt_chunks()
                if not batch and not chunks:
                    if self.scheduler.waiting or self.local_prefills.queue:
                        self._stopped.wait(0.01)  # waiting for blocks that only a release can free
                    continue
                self._step(batch, chunks)
            except Exception as exc:  # a failure must end the affected streams, never the engine thread
                logger.exception("decode step failed (%d sequences, %d prompt chunks)", len(batch), len(chunks))
                self._fail_step(batch, chunks, exc)
            finally:
                self._flush()

    def _place_received(self, seq: Sequence) -> None:
        """A received cache joins. One received into its blocks is already there: they are only registered in the
        prefix cache, nothing is copied. One in a receive buffer (`kv_assembler`'s fallback) has its positions not
        already in shared blocks written into its blocks, and the buffer goes back."""
        kv, start = seq.pending_kv, seq.num_computed
        if kv.landed is None and start < seq.prompt_len:
            skip = start - kv.first_position
            self.runner.write_kv(seq.table, start, [(k[skip:], v[skip:]) for k, v in kv.layers])
        kv.release()
        seq.pending_kv = None
        seq.num_computed = seq.prompt_len
        self.pool.register(seq.table, seq.prompt_cache_ids, seq.prompt_len)

    def _prompt_chunks(self) -> list[Chunk]:
        chunks = []
        for chunk in self.local_prefills.next_chunks():
            seq = chunk.work.seq
            if chunk.last and isinstance(chunk.work, LocalPrefill) and seq.matcher is None \
                    and not self._with_matcher(seq):
                self.local_prefills.remove(chunk.work)
                self.pool.release(seq.table)
                continue
            chunks.append(chunk)
        return chunks

    def _with_matcher(self, seq: Sequence) -> bool:
        """Give a sequence about to be prefilled here its grammar's matcher (if it has a grammar); False: failed."""
        try:
            seq.matcher = self.guidance.matcher(seq.sampling)
        except InvalidRequest as exc:
            self._fail_soon(seq.request_id, str(exc), InvalidRequest)  # the event loop moves it to FAILED
            return False
        return True

    def _fail_step(self, batch: list[Sequence], chunks: list[Chunk], exc: Exception) -> None:
        """A forward that raised. With prompt chunks in it, the prompts are blamed and fail; the decode rows sampled
        nothing and simply run again next step (a slot rewritten is rewritten with the same KV). Without chunks, the
        decode rows fail: this worker failed, not the KV it was sent, so the coordinator blames it and moves them."""
        if chunks:
            for chunk in chunks:
                self._fail_prompt(chunk, f"local prefill failed on the worker: {exc}", RequestFailed)
            return
        for seq in batch:
            if not seq.is_finished:
                self._retire(seq, DecodeState.FAILED)
                self._fail_soon(seq.request_id, "decode step failed on the worker", RequestFailed)

    def _fail_prompt(self, chunk: Chunk, message: str, error: type[Exception]) -> None:
        """A prompt chunk's work leaves the queue and its sequence fails (unless it already ended)."""
        self.local_prefills.remove(chunk.work)
        if not chunk.work.seq.is_finished:
            self._retire(chunk.work.seq, DecodeState.FAILED)
            self._fail_soon(chunk.work.seq.request_id, message, error)

    def _step(self, batch: list[Sequence], chunks: list[Chunk]) -> None:
        started = time.perf_counter()
        plain, drafted = split_drafted(self.drafter, self.pool, batch)
        rows = [DecodeRow(seq.output_token_ids[-1], seq.total_len - 1, seq.table, seq.lora) for seq in plain]
        prompt_chunks, broken = self.runner.prompt_chunks(chunks, lambda c: c.last and isinstance(c.work, LocalPrefill))
        if broken:  # their images failed to encode: those requests fail, the rest of the step runs
            for chunk, exc in broken:
                self._fail_prompt(chunk, f"encoding its images failed: {exc}",
                                  InvalidRequest if isinstance(exc, InvalidRequest) else RequestFailed)
            chunks = [c for c in chunks if all(c is not b for b, _ in broken)]
            if not batch and not chunks:
                return
        with drafts_given_back_on_failure(self.pool, drafted):  # its rows run again next step
            logits = self.runner.forward(rows, verify_chunks(drafted) + prompt_chunks, self._answer_asks)
        now = time.perf_counter()
        self._stepped(batch, len(chunks), started, now)
        self._sample_decode(plain, logits[: len(plain)], started, now, len(batch))
        verified = len(plain) + sum(len(draft) + 1 for _, draft in drafted)
        self._verify(drafted, logits[len(plain) : verified], started, now, len(batch))
        self._prompts_computed(chunks, logits[verified:])
        self._flush()

    def _verify(self, drafted: list[tuple[Sequence, list[int]]], logits, started: float, now: float,
                batch_size: int) -> None:
        """Emit each drafted row's accepted run (`verified_runs`); the rejected positions' blocks go back."""
        for seq, run in verified_runs(drafted, logits, self.drafter, self.runner.eos_token_ids, self.guidance.masks):
            processor = self._processors[seq.request_id]
            step_ms, wait_ms = (now - seq.last_step_at) * 1000, max(0.0, started - seq.last_step_at) * 1000
            seq.last_step_at = now
            for j, (token, logprobs) in enumerate(run):
                # The run's tokens came in one step: the first carries its time, the others none.
                output = processor.append(token, step_ms if j == 0 else 0.0, logprobs, batch_size,
                                          wait_ms if j == 0 else 0.0)
                self._emit(seq.request_id, output)
                if output.finish_reason is not None:
                    self._retire(seq, DecodeState.FINISHED)
                    break
            else:
                seq.num_computed = seq.total_len - 1  # the last token and the accepted drafts have their KV
                self.pool.shrink(seq.table, seq.total_len)
                self._register_output_blocks(seq)

    def _sample_decode(self, batch: list[Sequence], logits, started: float, now: float, batch_size: int) -> None:
        if not batch:
            return
        picks = choose_batch(logits, batch, self.runner.eos_token_ids, self.guidance.masks)
        for seq, pick in zip(batch, picks):
            if pick is None:
                self._fail_soon(seq.request_id, grammar_failure(seq.matcher), InvalidRequest)
                self._retire(seq, DecodeState.FAILED)
                continue
            token, logprobs = pick
            output = self._processors[seq.request_id].append(
                token, (now - seq.last_step_at) * 1000, logprobs, batch_size=batch_size,
                queue_wait_ms=max(0.0, started - seq.last_step_at) * 1000)
            seq.last_step_at = now
            self._register_output_blocks(seq)
            self._emit(seq.request_id, output)
            if output.finish_reason is not None:
                self._retire(seq, DecodeState.FINISHED)

    def _prompts_computed(self, chunks: list[Chunk], logits) -> None:
        done = self.local_prefills.computed(chunks)
        local = [w for w in done if isinstance(w, LocalPrefill) and w.seq.status is DecodeState.PREFILLING_LOCALLY]
        for work in done:
            if isinstance(work, Recompute) and not work.seq.is_finished:
                self.scheduler.add(work.seq)  # resumes: joins the batch again with its last token
        if not local:
            return
        # The first token is masked like every later one; its matcher then holds it.
        picks = choose_batch(logits, [w.seq for w in local], self.runner.eos_token_ids, self.guidance.masks)
        for work, pick in zip(local, picks):
            seq = work.seq
            if pick is None:
                self._retire(seq, DecodeState.FAILED)
                self._fail_soon(seq.request_id, grammar_failure(seq.matcher), InvalidRequest)
                continue
            first, logprobs = pick
            self._start(seq, first, (time.perf_counter() - work.submitted_at) * 1000, logprobs)

