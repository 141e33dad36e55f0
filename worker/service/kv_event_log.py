"""A worker's KV events: every block its prefix cache stores or removes, numbered and sent in batches to each
subscriber (a coordinator), after a snapshot of what the cache holds.

Life of a subscription:
  1. A coordinator subscribes: the KvEvents.Watch call (a gRPC stream), or `watch_kv_events` on its token channel.
  2. It gets a snapshot at once: every block the cache holds (batches with `snapshot`, the first with `reset`),
     current at least to the log's count then.
  3. Then every change, in batches: a change after a quiet spell leaves at once (the next loop turn), and
     further ones wait until PUBLISH_INTERVAL_S after the last batch, so a busy worker sends at most one
     batch per interval. The block pool records each change under its lock (`KvEventLog.stored` /
     `removed`), on whatever thread runs the engine, and the event loop numbers and sends them.
  4. A Watch stream more than MAX_BEHIND_BATCHES behind (its coordinator not reading) loses its backlog and gets
     a new snapshot in its place. A subscription ends with its stream or channel, or when the worker drains.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import threading
from collections.abc import AsyncIterator, Callable

from kv_events.block_hash import ROOT_HASH, hash_to_bytes
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from worker.engine.block_pool import BlockPool

logger = logging.getLogger(__name__)

# At most one batch per interval: on a busy worker, changes leave together, not one message per block.
PUBLISH_INTERVAL_S = 0.02
SNAPSHOT_BATCH_EVENTS = 8192
MAX_BEHIND_BATCHES = 256


def _stored_pb(block_hash: int, parent: int, num_tokens: int, medium: int = 0) -> pb.KvBlockEvent:
    return pb.KvBlockEvent(hash=hash_to_bytes(block_hash), parent_hash=hash_to_bytes(parent) if parent != ROOT_HASH
                           else b"", num_tokens=num_tokens, medium=medium)


class KvEventLog:
    """One worker's numbered prefix-cache changes, and the subscribers they go to."""

    def __init__(self, pool: BlockPool, role: str, loop: asyncio.AbstractEventLoop):
        self.epoch = secrets.token_hex(8)
        self.role = role
        self.block_size = pool.block_size
        self.seq = 0  # changes published so far
        self._pool = pool
        self._loop = loop
        self._lock = threading.Lock()
        # (hash, parent, tokens, medium) stored, or (hash, medium) removed
        self._pending: list[tuple[int, int, int, int] | tuple[int, int]] = []
        self._armed = False
        self._last_published = float("-inf")
        self._subscribers: set[Callable[[pb.KvEventBatch], None]] = set()
        self._watches: set[_QueuedWatch] = set()
        self.closed = False
        pool.registered_blocks(self)  # hears of every change from now on

    # the block pool's side (any thread, the pool's lock held) -------------------------------------------
    def stored(self, block_hash: int, parent_hash: int, num_tokens: int, medium: int = 0) -> None:
        self._record((block_hash, parent_hash, num_tokens, medium))

    def removed(self, block_hash: int, medium: int = 0) -> None:
        self._record((block_hash, medium))

    def _record(self, change) -> None:
        with self._lock:
            self._pending.append(change)
            if self._armed:
                return
            self._armed = True
        try:
            self._loop.call_soon_threadsafe(self._arm)
        except RuntimeError:  # the loop closed: the worker is stopping and nobody subscribes any more
            pass

    # the event loop's side -----------------------------------------------------------------------------
    def _arm(self) -> None:
        wait = self._last_published + PUBLISH_INTERVAL_S - self._loop.time()
        if wait > 0:
            self._loop.call_later(wait, self.publish)
        else:
            self._loop.call_soon(self.publish)

    def publish(self) -> None:
        """Number the changes recorded since the last call and send them to every subscriber as one batch."""
        with self._lock:
            pending, self._pending, self._armed = self._pending, [], False
        if not pending:
            return
        self._last_published = self._loop.time()
        self.seq += len(pending)
        if not self._subscribers:
            return
        events = [_stored_pb(*change) if len(change) == 4
                  else pb.KvBlockEvent(hash=hash_to_bytes(change[0]), removed=True, medium=change[1])
                  for change in pending]
        batch = pb.KvEventBatch(epoch=self.epoch, seq=self.seq, role=self.role, block_size=self.block_size,
                                events=events)
        for deliver in list(self._subscribers):
            deliver(batch)

    def snapshot(self) -> list[pb.KvEventBatch]:
        """What the cache holds now, as snapshot batches (at least one, the first with `reset`)."""
        blocks = self._pool.registered_blocks()
        batches = []
        for start in range(0, max(len(blocks), 1), SNAPSHOT_BATCH_EVENTS):
            batches.append(pb.KvEventBatch(
                epoch=self.epoch, seq=self.seq, reset=not batches, snapshot=True, role=self.role,
                block_size=self.block_size,
                events=[_stored_pb(h, parent, self.block_size, medium)
                        for h, parent, medium in blocks[start:start + SNAPSHOT_BATCH_EVENTS]]))
        return batches

    def subscribe(self, deliver: Callable[[pb.KvEventBatch], None]) -> None:
        """Send `deliver` the snapshot now, then every batch until `unsubscribe` (or the log closes)."""
        if self.closed:
            return
        for batch in self.snapshot():
            deliver(batch)
        self._subscribers.add(deliver)

    def unsubscribe(self, deliver: Callable[[pb.KvEventBatch], None]) -> None:
        self._subscribers.discard(deliver)

    async def watch(self) -> AsyncIterator[pb.KvEventBatch]:
        """The batches of one Watch stream, until the log closes."""
        if self.closed:
            return
        watch = _QueuedWatch(self)
        self._watches.add(watch)
        self.subscribe(watch.push)
        try:
            while True:
                batch = await watch.next()
                if batch is None:
                    return
                yield batch
        finally:
            self.unsubscribe(watch.push)
            self._watches.discard(watch)

    def close(self) -> None:
        """End every Watch stream (the worker drains): coordinators stop routing on this cache."""
        self.closed = True
        self._subscribers.clear()  # token channels' subscriptions too
        for watch in list(self._watches):
            watch.end()


class _QueuedWatch:
    """One Watch stream's backlog: a subscriber too far behind gets a fresh snapshot instead of the changes, taken
    when it reads again (not while it lags: a snapshot per overflow would cost the worker's loop for nothing)."""

    def __init__(self, log: KvEventLog):
        self.log = log
        self.items: collections.deque[pb.KvEventBatch | None] = collections.deque()
        self.waiter: asyncio.Future | None = None
        self.stale = False  # the backlog was dropped: the next read starts with a new snapshot

    def push(self, batch: pb.KvEventBatch) -> None:
        if self.stale:
            return  # the snapshot taken at the next read covers it
        if len(self.items) >= MAX_BEHIND_BATCHES:
            logger.warning("a KV events subscriber fell %d batches behind: it gets a snapshot instead",
                           len(self.items))
            self.items.clear()
            self.stale = True
        else:
            self.items.append(batch)
        self._wake()

    def end(self) -> None:
        self.stale = False
        self.items.append(None)
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def next(self) -> pb.KvEventBatch | None:
        if self.stale:
            self.stale = False
            self.items.extend(self.log.snapshot())
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


class KvEventsServicer(pb_grpc.KvEventsServicer):
    """KvEvents.Watch over the worker's log."""

    def __init__(self, log: KvEventLog):
        self.log = log

    async def Watch(self, request: pb.WatchKvEventsRequest, context) -> AsyncIterator[pb.KvEventBatch]:
        async for batch in self.log.watch():
            yield batch
