"""Which work runs next, and in which KV blocks. Pure bookkeeping over the BlockPool: no torch, no threads.

Shared by the real and the simulated engines (and the planner's simulation), so all of them batch,
chunk, cache and preempt the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from worker.engine.block_pool import BlockPool, BlockTable
from worker.engine.sequence import DecodeState, Sequence


class PromptWork(Protocol):
    """Something whose tokens are computed into KV in chunks: a prompt on a prefill worker, a local prefill or
    a preempted sequence's recomputation on a decode worker."""

    token_ids: list[int]  # every position to compute
    cache_token_ids: list[int]  # the same as the prefix cache hashes them (media placeholders stand for the media)
    media: tuple  # the prompt's MediaSpans, whose encoder output fills their positions
    prepared_media: Any  # what the backend made of them before admission (prepare_media); None without media
    table: BlockTable
    extra_positions: int  # positions to hold beyond them once computed (a decode worker's next token)
    num_computed: int  # positions whose KV is in the table (cached hits count)
    started: bool  # its blocks are taken
    cached_tokens: int  # of them, found in the prefix cache when it started
    lora: Any  # the LoadedLora its forwards run under; None: the base model
    prompt_logprobs: int | None  # alternatives per prompt position to report (each position computed); None: none


@dataclass(frozen=True)
class Chunk:
    """Positions [start, end) of `work` in one forward; `last`: its final chunk (the token after it is sampled)."""

    work: PromptWork
    start: int
    end: int

    @property
    def last(self) -> bool:
        return self.end == len(self.work.token_ids)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class PrefillScheduler:
    """Prompts, oldest first, cut into chunks of at most `max_batch_tokens` tokens per forward in all.

    The oldest prompt always gets the first tokens of a forward, so none is starved; younger ones
    fill what is left, up to `max_batch_size` prompts. A prompt's leading blocks found in the prefix
    cache are not computed again: its first chunk starts at its first uncached token (the last
    token is always computed, for its logits).
    """

    def __init__(self, pool: BlockPool, max_batch_tokens: int = 2048, max_batch_size: int = 16):
        if max_batch_tokens <= 0 or max_batch_size <= 0:
            raise ValueError("max_batch_tokens and max_batch_size must be > 0")
        self.pool = pool
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.queue: list = []

    @property
    def num_queued_tokens(self) -> int:
        """Tokens still to compute, cached ones not counted."""
        return sum(len(w.token_ids) - w.num_computed for w in self.queue)

    def add(self, work: PromptWork) -> None:
        self.queue.append(work)

    def add_first(self, work: PromptWork) -> None:
        """Queue `work` ahead of everything (a preempted sequence: it was running before anything queued here)."""
        self.queue.insert(0, work)

    def remove(self, work: PromptWork) -> None:
        if work in self.queue:
            self.queue.remove(work)

    def next_chunks(self, budget: int | None = None) -> list[Chunk]:
        """The chunks of the next forward (within `budget` tokens, if smaller than max_batch_tokens). A prompt that
        cannot get its blocks yet waits, and no younger one starts before it; those already started go on."""
        budget = self.max_batch_tokens if budget is None else min(budget, self.max_batch_tokens)
        chunks: list[Chunk] = []
        blocked = False
        for work in self.queue:
            if budget <= 0 or len(chunks) >= self.max_batch_size:
                break
            if not work.started and (blocked or not self.start(work)):
                blocked = True
                continue
            n = min(len(work.token_ids) - work.num_computed, budget)
            chunks.append(Chunk(work, work.num_computed, work.num_computed + n))
            budget -= n
        return chunks

    def start(self, work: PromptWork) -> bool:
        """Give `work` its cached leading blocks and fresh blocks for the rest (and for what it needs next, so a
        finished one never waits for a block to go on); False if the pool cannot yet."""
        n = len(work.token_ids)
        # Prompt logprobs need every position's logits: such a prompt takes no cached block.
        work.num_computed = self.pool.cached_prefix(work.cache_token_ids, n - 1 if work.prompt_logprobs is None else 0,
                                                    work.table)
        if not self.pool.grow(work.table, n + work.extra_positions):
            self.pool.release(work.table)
            work.num_computed = 0
            return False
        work.started = True
        work.cached_tokens = work.num_computed
        return True

    def computed(self, chunks: list[Chunk]) -> list[PromptWork]:
        """Record a forward's chunks as computed; return the work that is now complete (out of the queue)."""
        done = []
        for chunk in chunks:
            work = chunk.work
            work.num_computed = chunk.end
            self.pool.register(work.table, work.cache_token_ids, chunk.end)
            if chunk.last:
                self.remove(work)
                done.append(work)
        return done


class DecodeScheduler:
    """The decode batch over the pool: sequences join when they have blocks and a seat (up to `max_running`),
    take a block whenever they fill one, and leave at once.

    When the pool runs dry the youngest running sequence is preempted: its blocks are released (the
    full ones stay cached) and it is handed to `on_preempt` to be recomputed and resumed later.
    """

    def __init__(self, pool: BlockPool, max_running: int = 64):
        self.pool = pool
        self.max_running = max_running
        self.waiting: list[Sequence] = []  # its KV is here (or recomputed): joins when blocks and a seat allow
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self, on_preempt: Callable[[Sequence], None]) -> tuple[list[Sequence], list[Sequence]]:
        """Give every running sequence a slot for its next token (preempting the youngest when the pool is dry),
        then let waiting ones join (none in a step that preempted: the freed blocks are for those running);
        return (newly joined, whole batch)."""
        preempted = self.num_preemptions
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if self.pool.grow(seq.table, seq.total_len):
                i += 1
                continue
            victim = self._victim()
            if victim is None or (victim is seq and not seq.can_recompute):
                # Nothing to preempt but itself, which would leave this worker: a waiting sequence's blocks are
                # taken instead, if one holds any; else it waits a step (others may finish).
                holder = next((w for w in reversed(self.waiting) if w.table.block_ids), None)
                if holder is not None:
                    self.waiting.remove(holder)
                    self._preempt_blocks(holder, on_preempt)
                    continue
                i += 1
                continue
            self._preempt(victim, on_preempt)
            if victim is not seq:
                continue  # retry the same sequence with the freed blocks
        joined = []
        while self.waiting and len(self.running) < self.max_running and self.num_preemptions == preempted:
            seq = self.waiting[0]
            if not self.pool.grow(seq.table, seq.total_len):
                if not self.running:
                    self._unblock(seq, on_preempt)
                break
            self.waiting.pop(0)
            self.running.append(seq)
            joined.append(seq)
        batch = [seq for seq in self.running if seq.table.num_blocks * self.pool.block_size >= seq.total_len]
        return joined, batch

    def _unblock(self, head: Sequence, on_preempt: Callable[[Sequence], None]) -> None:
        """Nothing runs and the head of the line cannot join: younger waiting sequences that hold blocks give them
        up (and are recomputed later), or nothing would ever free one."""
        for seq in reversed(self.waiting[1:]):
            if self.pool.can_grow(head.table, head.total_len):
                return
            if seq.table.block_ids:  # recomputed later, or moved on if it cannot be (on_preempt decides)
                self.waiting.remove(seq)
                self._preempt_blocks(seq, on_preempt)

    def _victim(self) -> Sequence | None:
        """The youngest sequence this worker can recompute; else the youngest (`on_preempt` moves it elsewhere)."""
        for seq in reversed(self.running):
            if seq.can_recompute:  # recomputing needs the prompt's tokens (and images)
                return seq
        return self.running[-1] if self.running else None

    def _preempt(self, seq: Sequence, on_preempt: Callable[[Sequence], None]) -> None:
        self.running.remove(seq)
        self._preempt_blocks(seq, on_preempt)

    def _preempt_blocks(self, seq: Sequence, on_preempt: Callable[[Sequence], None]) -> None:
        self.pool.release(seq.table)
        seq.num_computed = 0
        self.num_preemptions += 1
        on_preempt(seq)

    def finish(self, seq: Sequence, status: DecodeState = DecodeState.FINISHED) -> None:
        """End a sequence: out of the batch, its blocks released (full ones stay cached)."""
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.release(seq.table)

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running + self.waiting:
            if seq.request_id == request_id:
                return seq
        return None
