"""vLLM's KV events into the coordinator's KvIndex, so cache_affinity routes over vLLM instances as over pdserve's.

vLLM (`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": ...}'`) publishes
each batch as a ZMQ message [topic, seq (8 bytes, big-endian), msgpack([ts, events, dp_rank])], each event
`BlockStored` (its block hashes, the parent's, the blocks' token ids, the block size), `BlockRemoved` (hashes)
or `AllBlocksCleared`. Its hashes are its own (sha256 by default), so each stored block is hashed again the
way pdserve's index does (kv_events/block_hash.py), chained from its parent's pdserve hash, and the index is
fed pb.KvEventBatches as from a pdserve worker. A block stored under a LoRA adapter (`lora_name`) is hashed with
its token ids salted by that adapter's identity, as the coordinator's LoraRegistry serves it.

Life of one instance's subscription (VllmKvEventWatch):
  1. The instance becomes routable: a SUB socket connects to its `kv_events` endpoint (vLLM binds a wildcard
     or ipc:// endpoint).
  2. The first BlockStored gives the block size: a snapshot batch (`reset`) starts the instance's entries.
     vLLM keeps no snapshot to ask for, so blocks stored before the subscription stay unknown (routing sees
     less cache than there is, never more), and so do blocks chained to them.
  3. A gap in vLLM's sequence numbers, or AllBlocksCleared, starts the entries over (a new epoch).
  4. The instance stops being routable: the socket closes and its entries go.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable

import msgpack
import zmq
import zmq.asyncio

from coordinator.workers.instances import Instance
from coordinator.workers.kv_event_watch import InstanceFollowers
from coordinator.scheduling.kv_index import KvIndex
from kv_events.block_hash import ROOT_HASH, chain_hashes, hash_to_bytes, lora_cache_tokens
from proto import worker_pb2 as pb

logger = logging.getLogger(__name__)

RETRY_S = 1.0
# Positional field order of vLLM's events when they come as arrays (the tag first).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _medium(fields: dict) -> int:
    """pdserve's medium of a vLLM event: its GPU (or unnamed) cache is the pool; CPU or storage offloading (vLLM's
    offloading connector) is the tier."""
    medium = fields.get("medium")
    return 0 if medium is None or str(medium).upper() == "GPU" else 1


def _fields(event) -> tuple[str, dict]:
    """An event's type and fields, whether it came as a tagged map or a tagged array."""
    if isinstance(event, dict):
        return event.get("type", ""), event
    if isinstance(event, (list, tuple)) and event:
        kind = event[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS
        return kind, dict(zip(names, event[1:]))
    return "", {}


class VllmEventTranslator:
    """One vLLM instance's events as pb.KvEventBatches in pdserve's hashes (module docstring, steps 2 and 3)."""

    def __init__(self, role: str, lora_digest: Callable[[str], int | None] = lambda name: None):
        self.role = role
        self.lora_digest = lora_digest  # a served adapter's identity by name (None: not served here)
        self.block_size = 0
        self.epoch = ""
        self.seq = 0  # pdserve events sent in this epoch
        self._hashes: dict[object, int] = {}  # vLLM's hash -> pdserve's
        self._media: dict[object, int] = {}  # vLLM's hash -> bit mask of the media holding it (1: pool, 2: tier)
        self._last_vllm_seq: int | None = None

    def batch(self, vllm_seq: int, payload: bytes) -> list[pb.KvEventBatch]:
        """The batches one vLLM message makes (a reset first when the entries start over)."""
        batches = []
        if self._last_vllm_seq is not None and vllm_seq != self._last_vllm_seq + 1:
            self._start_over(batches)
        self._last_vllm_seq = vllm_seq
        message = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        events: list[pb.KvBlockEvent] = []
        for event in message[1]:
            kind, fields = _fields(event)
            if kind == "BlockStored":
                if not self.block_size:
                    self.block_size = int(fields["block_size"])
                    batches.append(self._reset())
                events.extend(self._stored(fields))
            elif kind == "BlockRemoved":
                events.extend(self._removed(fields))
            elif kind == "AllBlocksCleared":
                if events:
                    batches.append(self._changes(events))
                    events = []
                self._start_over(batches)
        if events:
            batches.append(self._changes(events))
        return batches

    def _start_over(self, batches: list[pb.KvEventBatch]) -> None:
        """Forget every block: a new, empty snapshot (or, before the block size is known, nothing yet)."""
        self._hashes.clear()
        self._media.clear()
        if self.block_size:
            batches.append(self._reset())

    def _reset(self) -> pb.KvEventBatch:
        self.epoch, self.seq = secrets.token_hex(8), 0
        return pb.KvEventBatch(epoch=self.epoch, seq=0, reset=True, snapshot=True, role=self.role,
                               block_size=self.block_size)

    def _changes(self, events: list[pb.KvBlockEvent]) -> pb.KvEventBatch:
        self.seq += len(events)
        return pb.KvEventBatch(epoch=self.epoch, seq=self.seq, role=self.role, block_size=self.block_size,
                               events=events)

    def _stored(self, fields: dict) -> list[pb.KvBlockEvent]:
        parent_vllm = fields.get("parent_block_hash")
        lora = fields.get("lora_name")
        digest = self.lora_digest(lora) if lora else None
        # A LoRA block's extra keys name its adapter alone; anything else (media, a cache salt) no prompt matches.
        extra = [key for key in fields.get("extra_keys") or () if key and tuple(key) != (lora,)]
        if extra or int(fields.get("group_idx") or 0) or (lora and digest is None):
            return []  # media, another cache group or an adapter not served here: no prompt's hashes could match
        parent = ROOT_HASH if parent_vllm is None else self._hashes.get(parent_vllm)
        if parent is None or int(fields["block_size"]) != self.block_size:
            return []  # chained to a block stored before the subscription: its pdserve hash is unknown
        # Under an adapter, its token ids salted as pdserve's workers and the coordinator hash them.
        hashes = chain_hashes(lora_cache_tokens(fields["token_ids"], digest), self.block_size, parent)
        medium = _medium(fields)
        events = []
        for vllm_hash, ours in zip(fields["block_hashes"], hashes):
            self._hashes[vllm_hash] = ours
            self._media[vllm_hash] = self._media.get(vllm_hash, 0) | (1 << medium)
            events.append(pb.KvBlockEvent(hash=hash_to_bytes(ours), num_tokens=self.block_size,
                                          parent_hash=hash_to_bytes(parent) if parent else b"", medium=medium))
            parent = ours
        return events

    def _removed(self, fields: dict) -> list[pb.KvBlockEvent]:
        events = []
        medium = _medium(fields)
        for vllm_hash in fields.get("block_hashes") or ():
            ours = self._hashes.get(vllm_hash)
            if ours is None:
                continue
            events.append(pb.KvBlockEvent(hash=hash_to_bytes(ours), removed=True, medium=medium))
            left = self._media.get(vllm_hash, 0) & ~(1 << medium)
            if left:
                self._media[vllm_hash] = left
            else:  # in no medium any more: a later block cannot chain to it
                del self._hashes[vllm_hash]
                self._media.pop(vllm_hash, None)
        return events


class VllmKvEventWatch(InstanceFollowers):
    """A ZMQ subscription per routable vLLM instance with a `kv_events` endpoint, fed into `index`."""

    def __init__(self, index: KvIndex, endpoints: dict[str, str],
                 lora_digest: Callable[[str], int | None] = lambda name: None):
        super().__init__(index)
        self.endpoints = endpoints
        self.lora_digest = lora_digest  # LoRA blocks are hashed under their served adapter's identity
        self._context = zmq.asyncio.Context()

    async def stop(self) -> None:
        await super().stop()
        self._context.term()

    def _follows(self, instance: Instance) -> bool:
        return bool(self.endpoints.get(instance.address))

    async def _follow(self, instance: Instance) -> None:
        address, role, endpoint = instance.address, instance.role, self.endpoints[instance.address]
        follower = asyncio.current_task()
        while True:
            socket = self._context.socket(zmq.SUB)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.connect(endpoint)
            translator = VllmEventTranslator(role, self.lora_digest)
            try:
                while True:
                    parts = await socket.recv_multipart()
                    if len(parts) != 3 or not self._current(address, follower):
                        continue
                    for batch in translator.batch(int.from_bytes(parts[1], "big"), parts[2]):
                        if not self.index.apply(address, batch):
                            translator = VllmEventTranslator(role, self.lora_digest)  # out of step: start over
                            break
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the watch must outlive any one bad message
                logger.exception("KV events of vLLM instance %s failed", address)
            finally:
                socket.close()
            self.index.drop(address)
            await asyncio.sleep(RETRY_S)
