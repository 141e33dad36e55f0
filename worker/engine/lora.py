"""Which LoRA adapters a worker holds, and a request's claim on one (no torch).

Life cycle of an adapter on a worker:
  1. A request names it (`LoraRef`: name, folder, identity); the servicer asks `LoraResidency.acquire`.
  2. Resident already: the request pins it. Otherwise, when fewer than `max_loras` are resident (or one resident
     is pinned by nobody: the least recently used such one is evicted), it is loaded off the event loop by the
     backend's `load` and pinned. With every resident adapter pinned, the request waits (counted as waiting).
  3. The request's forwards read the loaded weights through its claim; when it ends, `release` unpins it. An
     unpinned adapter stays resident for later requests until evicted, or until `unload` drops it.
A folder missing on this worker, or changed since the coordinator read it (another identity), is `LoraUnavailable`:
the coordinator tries another worker. A folder that is no adapter of this model is the request's InvalidRequest.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kv_events.block_hash import HASH_BYTES, hash_from_bytes
from worker.engine.errors import InvalidRequest


class LoraUnavailable(Exception):
    """This worker cannot load the request's adapter (its folder is missing or differs here); another may."""


@dataclass(frozen=True)
class LoraRef:
    """An adapter as a request names it: its served name, its folder and its identity (`adapter_digest`)."""

    name: str
    path: str
    digest: int


def lora_from_pb(msg) -> LoraRef | None:
    """A request's pb.LoraAdapter, checked; None when it names none (the base model)."""
    if not msg.name:
        return None
    if len(msg.digest) != HASH_BYTES or not msg.path:
        raise InvalidRequest(f"lora {msg.name!r}: needs its folder's path and a {HASH_BYTES}-byte digest")
    return LoraRef(msg.name, msg.path, hash_from_bytes(msg.digest))


@dataclass(eq=False)
class LoadedLora:
    """A resident adapter: what the backend's `load` made of its folder, and how many requests pin it."""

    ref: LoraRef
    weights: Any
    pins: int = 0


@dataclass
class LoraResidency:
    """The adapters resident on one worker, at most `max_loras`, evicted least recently used among the unpinned."""

    max_loras: int
    max_rank: int
    load: Callable[[LoraRef], Any]  # folder -> weights (blocking: run on a thread); AdapterError / LoraUnavailable
    resident: OrderedDict[str, LoadedLora] = field(default_factory=OrderedDict)
    waiting: dict[str, int] = field(default_factory=dict)  # adapter name -> requests waiting for a place
    _changed: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    @property
    def running(self) -> list[str]:
        """Names of the adapters pinned by at least one request."""
        return [name for name, lora in self.resident.items() if lora.pins]

    async def acquire(self, ref: LoraRef) -> LoadedLora:
        """Pin `ref`'s adapter for a request, loading it first when needed (waiting while every place is pinned)."""
        changed = self._condition()
        async with changed:
            self.waiting[ref.name] = self.waiting.get(ref.name, 0) + 1
            try:
                while True:
                    lora = self.resident.get(ref.name)
                    if lora is not None and lora.ref == ref:
                        self.resident.move_to_end(ref.name)
                        lora.pins += 1
                        return lora
                    if self._make_room(ref.name):
                        break
                    await changed.wait()
            finally:
                self._unwait(ref.name)
            weights = await asyncio.to_thread(self.load, ref)
            lora = self.resident[ref.name] = LoadedLora(ref, weights, pins=1)
            return lora

    def _make_room(self, name: str) -> bool:
        """Free a place for `name` (replacing another identity under that name, or the least recently used unpinned
        adapter); False when every place is pinned."""
        old = self.resident.get(name)
        if old is not None:
            if old.pins:
                return False  # the old identity ends its requests first
            del self.resident[name]
        if len(self.resident) < self.max_loras:
            return True
        for key, lora in self.resident.items():
            if not lora.pins:
                del self.resident[key]
                return True
        return False

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
        if not lora.pins:
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        changed = self._condition()
        async with changed:
            changed.notify_all()

    def unload(self, name: str) -> bool:
        """Drop `name` once no request pins it; whether it was resident and unpinned."""
        lora = self.resident.get(name)
        if lora is None or lora.pins:
            return False
        del self.resident[name]
        return True


def refuse_lora(ref: LoraRef | None, backend: str) -> None:
    """A backend without adapters answers a request that names one: InvalidRequest naming it."""
    if ref is not None:
        raise InvalidRequest(f"LoRA adapter {ref.name!r}: {backend} serves no LoRA adapters")
