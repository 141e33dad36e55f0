"""Which LoRA adapters a worker holds, and a request's claim on one (no torch).

Life cycle of an adapter on a worker:
  1. A request names it (an `AdapterRef`: name, folder, identity); the servicer asks `LoraResidency.acquire`.
  2. Resident already: the request pins it (waiting for its load to end, if another request started it).
     Otherwise, when fewer than `max_loras` are resident (or one resident is pinned by nobody: the least recently
     used such one is evicted), its place is taken at once and it is loaded off the event loop by the backend's
     `load`, pinned. With every resident adapter pinned, the request waits (counted as waiting).
  3. The request's forwards read the loaded weights through its claim; when it ends, `release` unpins it. An
     unpinned adapter stays resident for later requests until it is evicted.
A folder this worker cannot load (missing here, changed since the coordinator read it, beyond this worker's
--max-lora-rank, unreadable) is `LoraUnavailable` for that request alone: the coordinator tries another worker.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from adapters.peft_folder import AdapterRef
from kv_events.block_hash import HASH_BYTES, hash_from_bytes
from worker.engine.errors import InvalidRequest


class LoraUnavailable(Exception):
    """This worker cannot load the request's adapter (its folder is missing or differs here); another may."""


def lora_from_pb(msg) -> AdapterRef | None:
    """A request's pb.LoraAdapter, checked; None when it names none (the base model)."""
    if not msg.name:
        return None
    if len(msg.digest) != HASH_BYTES or not msg.path:
        raise InvalidRequest(f"lora {msg.name!r}: needs its folder's path and a {HASH_BYTES}-byte digest")
    return AdapterRef(msg.name, msg.path, hash_from_bytes(msg.digest))


@dataclass(eq=False)
class LoadedLora:
    """A resident adapter: what the backend's `load` made of its folder, how many requests pin it, and (while
    it loads) the future its load ends."""

    ref: AdapterRef
    weights: Any
    pins: int = 0
    loading: asyncio.Future | None = None
    slot: int = 0  # its place among the max_loras: where the backend keeps its weights


@dataclass
class LoraResidency:
    """The adapters resident on one worker, at most `max_loras`, evicted least recently used among the unpinned."""

    max_loras: int
    # (folder, its place) -> weights kept in that place (blocking: run on a thread); LoraUnavailable when it cannot
    load: Callable[[AdapterRef, int], Any]
    resident: OrderedDict[str, LoadedLora] = field(default_factory=OrderedDict)
    waiting: dict[str, int] = field(default_factory=dict)  # adapter name -> requests waiting for a place
    _freed: asyncio.Event | None = None  # set by a release: requests waiting for a place look again
    _free_slots: list[int] | None = None  # places no resident adapter holds

    @property
    def running(self) -> list[str]:
        """Names of the adapters pinned by at least one request (a snapshot: /metrics reads it from its thread)."""
        return [name for name, lora in tuple(self.resident.items()) if lora.pins]

    async def acquire(self, ref: AdapterRef) -> LoadedLora:
        """Pin `ref`'s adapter for a request, loading it first when needed (waiting while every place is pinned);
        LoraUnavailable when it cannot be loaded here. Everything between awaits runs on the event loop, so a look
        and the place it takes are one step."""
        if self._freed is None:
            self._freed = asyncio.Event()
        self.waiting[ref.name] = self.waiting.get(ref.name, 0) + 1
        try:
            while True:
                self._freed.clear()  # before looking: a release from here on wakes the wait below
                lora = self.resident.get(ref.name)
                if lora is not None and lora.ref == ref:
                    self.resident.move_to_end(ref.name)
                    lora.pins += 1
                    if lora.loading is not None:
                        try:
                            await asyncio.shield(lora.loading)
                        except BaseException:
                            lora.pins -= 1
                            raise
                    return lora
                slot = self._make_room(ref.name)
                if slot is not None:
                    return await self._load(ref, slot)
                await self._freed.wait()
        finally:
            self._unwait(ref.name)

    async def _load(self, ref: AdapterRef, slot: int) -> LoadedLora:
        """Take place `slot` for `ref` now, load it on a thread (other adapters' requests go on meanwhile)."""
        lora = self.resident[ref.name] = LoadedLora(ref, None, pins=1,
                                                    loading=asyncio.get_running_loop().create_future(), slot=slot)
        try:
            lora.weights = await asyncio.to_thread(self.load, ref, slot)
        except BaseException as exc:
            if self.resident.get(ref.name) is lora:
                del self.resident[ref.name]
                self._free_slots.append(slot)
            failure = exc if isinstance(exc, Exception) else LoraUnavailable(f"LoRA adapter {ref.name!r}: its load "
                                                                              "was cancelled")
            lora.loading.set_exception(failure)
            lora.loading.exception()  # retrieved here: requests waiting on it re-raise it themselves
            lora.pins -= 1
            self._freed.set()
            raise
        lora.loading.set_result(None)
        lora.loading = None
        return lora

    def _make_room(self, name: str) -> int | None:
        """A free place for `name` (replacing another identity under that name, or the least recently used unpinned
        adapter); None when every place is pinned."""
        if self._free_slots is None:
            self._free_slots = list(range(self.max_loras))
        old = self.resident.get(name)
        if old is not None:
            if old.pins:
                return None  # the old identity ends its requests first
            self._evict(name)
        if not self._free_slots:
            victim = next((key for key, lora in self.resident.items() if not lora.pins), None)
            if victim is None:
                return None
            self._evict(victim)
        return self._free_slots.pop()

    def _evict(self, name: str) -> None:
        self._free_slots.append(self.resident.pop(name).slot)

    def _unwait(self, name: str) -> None:
        left = self.waiting[name] - 1
        if left:
            self.waiting[name] = left
        else:
            del self.waiting[name]

    def release(self, lora: LoadedLora | None) -> None:
        """A request's claim ends (None: it ran on the base model)."""
        if lora is None:
            return
        lora.pins -= 1
        if not lora.pins and self._freed is not None:
            self._freed.set()


def refuse_lora(ref: AdapterRef | None, backend: str) -> None:
    """A backend without adapters answers a request that names one: LoraUnavailable naming it (another worker of
    the cluster may serve it)."""
    if ref is not None:
        raise LoraUnavailable(f"LoRA adapter {ref.name!r}: {backend} serves no LoRA adapters")
