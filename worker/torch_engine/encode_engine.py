"""EncodeEngine: an encode worker's engine (`pdserve worker --role encode`): a vision-language checkpoint's vision
tower and projector, without its language model, and a cache of their outputs by image content hash.

Life of one Encode call:
  1. Its images are decoded and preprocessed on a thread (`VisionEncoder.prepare`: jpg or png, the pixel bound,
     the positions the coordinator laid out for each); one that fails is the call's INVALID_ARGUMENT.
  2. They join the line of images waiting for a forward. The batch loop takes every image waiting (up to
     `max_batch_images`, an image two calls share once) and runs them in one vision forward on a thread while the
     next ones gather: continuous batching, as a decode worker's steps.
  3. Each output goes into the cache (an image found there is not encoded again: `cached` in the answer); the
     cache's changes are KV events (one per image) that coordinators index to route an image where it is held.
  4. The call answers once all its images are held; a prefill worker pulls each (EncoderService.PullEmbeddings)
     while the cache keeps it, least recently used dropped first.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from kv_transfer.codec import tensor_bytes
from worker.engine.load import WorkerLoad
from worker.engine.media import MediaSpan
from worker.torch_engine.model_runner import DTYPES, refuse_unsupported_vision, resolve_device
from worker.torch_engine.vision import PreparedMedia, VisionEncoder

logger = logging.getLogger(__name__)

DEFAULT_CACHE_IMAGES = 256  # an encode worker's memory is for embeddings: more than a prefill worker's 32


@dataclass(eq=False)
class _Waiting:
    """One call's images in the line for a forward."""

    media: tuple[MediaSpan, ...]
    prepared: PreparedMedia
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class EncodeEngine:
    """Images of concurrent calls encoded in shared forwards, outputs kept by content hash (life cycle above)."""

    role = "encode"

    def __init__(self, model_dir: Path | str, dtype: str = "auto", device: str = "auto",
                 cache_images: int | None = None, max_batch_images: int = 16):
        self.model_dir = Path(model_dir)
        config = AutoConfig.from_pretrained(self.model_dir)
        if not hasattr(config, "vision_config"):
            raise ValueError(f"--role encode needs a vision-language checkpoint; {self.model_dir.name} "
                             f"({config.model_type}) has no vision tower")
        refuse_unsupported_vision(config)
        self.device = resolve_device(device)
        kwargs = {} if dtype == "auto" else {"dtype": DTYPES[dtype]}
        model = AutoModelForImageTextToText.from_pretrained(self.model_dir, attn_implementation="sdpa", **kwargs)
        model.model.language_model = None  # never run here: its weights are freed before moving to the device
        model.lm_head = None
        self.model = model.to(self.device).eval()
        cache_images = DEFAULT_CACHE_IMAGES if cache_images is None else cache_images
        self.vision = VisionEncoder(self.model, AutoProcessor.from_pretrained(self.model_dir), self.device,
                                    cache_images)
        self.pool = self.vision.cache  # what its KV events describe
        self.max_batch_images = max_batch_images
        self.model_name = self.model_dir.name
        self.metrics = None  # set by the server (WorkerMetrics)
        self._waiting: list[_Waiting] = []
        self._in_flight: dict[int, asyncio.Future] = {}  # images being decoded or encoded, by content hash
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.num_running = 0  # images in the forward now
        logger.info("loaded the vision tower of %s (%s) on %s, caching %d images", self.model_dir,
                    self.model.dtype, self.device, cache_images)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._batches())

    def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()

    @property
    def num_waiting(self) -> int:
        return sum(len(w.media) for w in self._waiting)

    async def encode(self, media: tuple[MediaSpan, ...]) -> list[tuple[tuple[int, int], bool]]:
        """Each item's output shape (rows, hidden) and whether it was found (cached, or being encoded for another
        call: an image is decoded and encoded once however many calls bring it); InvalidRequest for an item that
        does not decode or fit its positions."""
        shapes: dict[int, tuple[int, int]] = {}
        others: dict[int, asyncio.Future] = {}
        mine: list[MediaSpan] = []
        for span in media:
            h = span.content_hash
            if h in shapes or h in others or any(s.content_hash == h for s in mine):
                continue
            if h in self._in_flight:
                others[h] = self._in_flight[h]
            elif (held := self.vision.cached(h)) is not None:
                shapes[h] = tuple(held.shape)
            else:
                mine.append(span)
                self._in_flight[h] = asyncio.get_running_loop().create_future()
        if mine:
            await self._encode_mine(tuple(mine), shapes)
        for h, future in others.items():
            shapes[h] = await asyncio.shield(future)
        encoded = {span.content_hash for span in mine}
        return [(shapes[span.content_hash], span.content_hash not in encoded) for span in media]

    async def _encode_mine(self, mine: tuple[MediaSpan, ...], shapes: dict[int, tuple[int, int]]) -> None:
        """Decode, then encode in the next batch, the images this call is the first to bring."""
        try:
            prepared = await asyncio.to_thread(self.vision.prepare, mine)
            waiting = _Waiting(mine, prepared)
            self._waiting.append(waiting)
            self._wake.set()
            features = await waiting.done
        except BaseException as exc:
            for span in mine:
                future = self._in_flight.pop(span.content_hash)
                if not future.done():  # other calls waiting on it fail with it (or retry, if it was cancelled)
                    future.set_exception(exc if isinstance(exc, Exception) else RuntimeError("encode cancelled"))
                    future.exception()  # retrieved here: no "never retrieved" warning when none waits
            raise
        for span in mine:
            shapes[span.content_hash] = tuple(features[span.content_hash].shape)
            self._in_flight.pop(span.content_hash).set_result(shapes[span.content_hash])

    def held(self, content_hash: int) -> tuple[int, int, str, memoryview] | None:
        """The cached output of an image as (rows, hidden, dtype, its bytes), for a prefill worker's pull; None
        once evicted."""
        features = self.vision.cached(content_hash)  # a pull keeps the image recent, as an Encode call does
        if features is None:
            return None
        rows, hidden = features.shape
        return rows, hidden, self.vision.embeddings_dtype, tensor_bytes(features.cpu())

    def load(self) -> WorkerLoad:
        return WorkerLoad("encode", self.model_name, self.num_running, self.num_waiting, 0, 0)

    async def _batches(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._waiting:
                batch, images = [], 0
                while self._waiting and (not batch or images + len(self._waiting[0].media) <= self.max_batch_images):
                    batch.append(self._waiting.pop(0))
                    images += len(batch[-1].media)
                await self._run(batch)

    async def _run(self, batch: list[_Waiting]) -> None:
        spans = list({span.content_hash: span for w in batch for span in w.media}.values())
        merged = PreparedMedia()
        for w in batch:
            merged.pixels.update(w.prepared.pixels)
        self.num_running = len(spans)
        try:
            features = await asyncio.to_thread(self.vision.embeddings, spans, merged)
        except Exception as exc:  # noqa: BLE001 (one call's bad image must not fail the others: each alone)
            if len(batch) > 1:
                for w in batch:
                    await self._run([w])
                return
            features = exc
        finally:
            self.num_running = 0
        for w in batch:
            if w.done.done():
                continue  # its caller left
            if isinstance(features, Exception):
                w.done.set_exception(features)
            else:
                w.done.set_result(features)
