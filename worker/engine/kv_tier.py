"""The KV tier under a worker's block pool: prefix-cache blocks the pool evicts, kept in a file on local disk.

Life of a block in the tier:
  1. The pool evicts a cached block (it needs the memory): the backend copies the block's bytes out at once
     (`BlockBytes.read_block`, before anything overwrites it) and the tier queues them.
  2. The tier's writer thread gives them a slot (evicting the tier's least recently used entry when full),
     writes them with their xxh3-64 checksum, and only then announces the block (`stored`, medium tier).
  3. A prompt that misses the pool looks the next blocks up here (`BlockPool.more_cached_prefix`): each is read
     back, checked against its checksum and written into a fresh pool block instead of being computed. A
     damaged or missing one ends the lookup there (it is dropped and announced removed): recomputed, never served.
  4. A write or read error (a full or failing disk) turns the tier off with a warning: every entry is announced
     removed, and serving goes on from the pool alone.

The simulated backend keeps the same bookkeeping with empty payloads (no file); its cost model charges a load
per block. No torch here: the backend's `BlockBytes` moves the bytes in and out of its pool.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import xxhash

logger = logging.getLogger(__name__)

TIER = 1  # KvBlockEvent.medium of a block in the tier (0: the pool)
MAX_PENDING_BYTES = 256 << 20  # evicted blocks waiting for the writer; more are dropped, not waited for


class BlockBytes(Protocol):
    """A backend's pool as bytes per block (the real one's tensors; the simulated one has none)."""

    block_bytes: int  # bytes of one block, every layer's keys and values

    def read_block(self, block: int) -> bytes | bytearray: ...
    def write_block(self, block: int, data: bytearray) -> None: ...


class EmptyBlocks:
    """The simulated backend's blocks: no bytes to keep, only their bookkeeping."""

    block_bytes = 0

    def read_block(self, block: int) -> bytes:
        return b""

    def write_block(self, block: int, data: bytes) -> None:
        pass


class TierListener(Protocol):
    """Hears of the tier's changes (the worker's KV event log)."""

    def stored(self, block_hash: int, parent_hash: int, num_tokens: int, medium: int = 0) -> None: ...
    def removed(self, block_hash: int, medium: int = 0) -> None: ...


def attach_tier(pool, directory: str | None, gigabytes: float, bytes_per_block: int, blocks: BlockBytes) -> None:
    """Put a tier of `gigabytes` under `pool` (a BlockPool), sized in blocks of `bytes_per_block` (the real bytes,
    or what the simulated backend models); `blocks` moves them."""
    if gigabytes <= 0:
        return
    capacity = int(gigabytes * (1 << 30)) // max(bytes_per_block, 1)
    tier = KvTier(Path(directory) if directory else None, capacity, blocks.block_bytes, pool.block_size)
    pool.attach_tier(tier, blocks)
    logger.info("KV tier: %d blocks (%.2f GiB)%s", capacity, gigabytes, f" in {tier.path}" if tier.path else "")


@dataclass
class _Entry:
    slot: int
    parent: int
    checksum: int


@dataclass(frozen=True)
class TierStats:
    """The tier's figures at one moment (for Health and metrics)."""

    enabled: bool
    capacity_blocks: int
    blocks: int
    hit_blocks: int  # blocks loaded into the pool instead of computed, since start
    written_blocks: int
    dropped_blocks: int  # found damaged or missing when read: recomputed


class KvTier:
    """Up to `capacity_blocks` blocks by chain hash, least recently used evicted first; thread-safe. A tier with
    `block_bytes` 0 (the simulated backend's) keeps no file."""

    def __init__(self, directory: Path | None, capacity_blocks: int, block_bytes: int, block_size: int):
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.enabled = self.capacity_blocks > 0
        self.listener: TierListener | None = None
        self.hit_blocks = self.written_blocks = self.dropped_blocks = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # hash -> entry, least recently used first
        self._free_slots: list[int] = []  # slots given back; slots from _next_slot on were never used
        self._next_slot = 0
        self._lock = threading.Lock()
        self._fd: int | None = None
        self.path: Path | None = None
        if self.enabled and block_bytes and directory is not None:
            self._open(Path(directory))
        # Blocks copied out and not yet written, at most MAX_PENDING_BYTES of them.
        self._queue: queue.Queue = queue.Queue(maxsize=max(16, MAX_PENDING_BYTES // max(block_bytes, 1)))
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()

    def _open(self, directory: Path) -> None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self.path = directory / f"pdserve-kv-{os.getpid()}-{secrets.token_hex(4)}.tier"
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            # The whole file up front: a disk that cannot hold it is found now, not mid-write.
            os.posix_fallocate(self._fd, 0, self.capacity_blocks * self.block_bytes)
        except OSError as exc:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            if self.path is not None:
                self.path.unlink(missing_ok=True)
            self._fail(f"cannot make its file in {directory}: {exc}")

    # the pool's side ------------------------------------------------------------------------------------
    def holds(self, block_hash: int) -> bool:
        return self.enabled and block_hash in self._entries

    def wants(self, block_hash: int) -> bool:
        """Whether a block the pool evicts should be copied out for the tier: not when the tier is off, holds it
        already (it came from here: it is only marked recently used) or its writer is too far behind."""
        if not self.enabled or self._queue.full():
            return False
        with self._lock:
            if block_hash in self._entries:
                self._entries.move_to_end(block_hash)
                return False
        return True

    def evicted(self, block_hash: int, parent: int, data: bytes) -> None:
        """The pool let go of this block (its bytes copied out, after `wants`): keep it, off the caller's path. A
        writer too far behind (a slow disk) drops it: the tier is a cache, and the pool must not wait."""
        try:
            self._queue.put_nowait((block_hash, parent, data))
        except queue.Full:
            pass

    def load(self, block_hash: int) -> bytearray | None:
        """The block's bytes, checked; None (the entry dropped) when it is missing, damaged or unreadable."""
        with self._lock:
            entry = self._entries.get(block_hash) if self.enabled else None
            if entry is None:
                return None
            self._entries.move_to_end(block_hash)
            fd = self._fd
        data = bytearray(self.block_bytes)  # writable: the backend copies from it without another copy
        if fd is not None:
            try:
                read = os.preadv(fd, [data], entry.slot * self.block_bytes)
            except OSError as exc:
                self._fail(f"a read failed: {exc}")
                return None
        else:
            read = 0
        if read != self.block_bytes or xxhash.xxh3_64_intdigest(data) != entry.checksum:
            with self._lock:
                if self._entries.get(block_hash) is not entry:
                    return None  # the writer took its slot meanwhile (the tier was full): gone, not damaged
                self.dropped_blocks += 1
                self._drop(block_hash)
            logger.warning("KV tier: a damaged block was dropped (it is recomputed)")
            return None
        with self._lock:
            self.hit_blocks += 1
        return data

    def entries(self, listener: TierListener | None = None) -> list[tuple[int, int]]:
        """(hash, parent hash) of every block the tier holds now; with `listener`, it hears of every change after
        this moment (one atomic step, as the pool's `registered_blocks`)."""
        with self._lock:
            if listener is not None:
                self.listener = listener
            return [(h, e.parent) for h, e in self._entries.items()]

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self.enabled, self.capacity_blocks, len(self._entries), self.hit_blocks,
                             self.written_blocks, self.dropped_blocks)

    def flush(self) -> None:
        """Wait until every block queued so far is written (tests; a stopping worker need not)."""
        done = threading.Event()
        self._queue.put(done)  # blocks while the queue is full: the writer empties it
        done.wait()

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(timeout=5)
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    # the writer thread ----------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
            elif self.enabled:
                self._write(*item)

    def _write(self, block_hash: int, parent: int, data: bytes) -> None:
        with self._lock:
            if block_hash in self._entries:
                return
            if not self._free_slots and self._next_slot == self.capacity_blocks:
                self._drop(next(iter(self._entries)))  # the least recently used
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                slot, self._next_slot = self._next_slot, self._next_slot + 1
            fd = self._fd
        if fd is not None:
            try:
                if os.pwrite(fd, data, slot * self.block_bytes) != len(data):
                    raise OSError("short write")
            except OSError as exc:
                self._fail(f"a write failed: {exc}")
                return
        with self._lock:
            if not self.enabled:
                return
            self._entries[block_hash] = _Entry(slot, parent, xxhash.xxh3_64_intdigest(data))
            self.written_blocks += 1
            if self.listener is not None:
                self.listener.stored(block_hash, parent, self.block_size, TIER)

    def _drop(self, block_hash: int) -> None:
        entry = self._entries.pop(block_hash)
        self._free_slots.append(entry.slot)
        if self.listener is not None:
            self.listener.removed(block_hash, TIER)

    def _fail(self, why: str) -> None:
        logger.warning("KV tier off (serving goes on from the pool alone): %s", why)
        with self._lock:
            self.enabled = False
            for block_hash in list(self._entries):
                self._drop(block_hash)
