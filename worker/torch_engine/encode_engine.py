"""EncodeEngine: an encode worker's engine (`pdserve worker --role encode`): a vision-language checkpoint's vision
tower and projector, without its language model, and a cache of their outputs by image content hash.

Life of one Encode call:
  1. Each image the cache holds is found; one another call is encoding now is waited for (if that call fails or
     leaves, this one encodes it itself). The rest are this call's: decoded and preprocessed on a thread
     (`VisionEncoder.prepare`: jpg or png, the pixel bound, the positions the coordinator laid out for each); one
     that fails is this call's INVALID_ARGUMENT.
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
import time
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from kv_transfer.codec import tensor_bytes
from worker.engine.load import WorkerLoad
from worker.engine.media import MediaSpan
from worker.torch_engine.model_support import DTYPES, refuse_unsupported_vision, resolve_device
from worker.torch_engine.vision import PreparedMedia, VisionEncoder

logger = logging.getLogger(__name__)

ENCODE_WORKER_CACHE_IMAGES = 256  # an encode worker's memory is for embeddings: more than a prefill worker's


@dataclass(eq=False)
class _Waiting:
    """One call's images in the line for a forward."""

    media: tuple[MediaSpan, ...]
    prepared: PreparedMedia
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    forward_s: float = 0.0  # its images' share of the forward they ran in


class GaveUp(Exception):
    """The call encoding an image for others failed or left: a call waiting on it encodes the image itself."""


class EncodeEngine:
    """Images of concurrent calls encoded in shared forwards, outputs kept by content hash (life cycle above)."""

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
        cache_images = ENCODE_WORKER_CACHE_IMAGES if cache_images is None else cache_images
        self.vision = VisionEncoder(self.model, AutoProcessor.from_pretrained(self.model_dir), self.device,
                                    cache_images)
        self.pool = self.vision.cache  # what its KV events describe
        self.max_batch_images = max_batch_images
        self.model_name = self.model_dir.name
        self.metrics = None  # set by the server (WorkerMetrics)
        self._waiting: list[_Waiting] = []
        self._in_flight: dict[int, asyncio.Future] = {}  # images being decoded or encoded, by content hash
        self._wake: asyncio.Event | None = None  # made in `start`, on the loop that serves
        self._task: asyncio.Task | None = None
        self.num_running = 0  # images in the forward now
        logger.info("loaded the vision tower of %s (%s) on %s, caching %d images", self.model_dir,
                    self.model.dtype, self.device, cache_images)

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._batches())
        self._task.add_done_callback(self._stopped)

    def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()

    @property
    def num_waiting(self) -> int:
        return sum(len(w.media) for w in self._waiting)

    async def encode(self, media: tuple[MediaSpan, ...]) -> tuple[list[tuple[tuple[int, int], bool]], float]:
        """Each item's output shape (rows, hidden) and whether it was found (cached, or encoded for another call:
        an image is decoded and encoded once however many calls bring it), and the seconds spent on this call's
        images; InvalidRequest for an item that does not decode or fit its positions."""
        shapes: dict[int, tuple[int, int]] = {}
        found: set[int] = set()
        busy_s = 0.0
        todo = list({span.content_hash: span for span in media}.values())
        while todo:  # twice at most: an image another call was encoding, which that call gave up, is encoded here
            mine, others = [], {}
            for span in todo:
                h = span.content_hash
                if h in self._in_flight:
                    others[h] = (span, self._in_flight[h])
                elif (held := self.vision.cached(h)) is not None:
                    shapes[h] = tuple(held.shape)
                    found.add(h)
                else:
                    mine.append(span)
                    self._in_flight[h] = asyncio.get_running_loop().create_future()
            if mine:
                busy_s += await self._encode_mine(tuple(mine), shapes)
            todo = []
            for h, (span, future) in others.items():
                try:
                    shapes[h] = await asyncio.shield(future)
                    found.add(h)
                except GaveUp:
                    todo.append(span)
        return [(shapes[span.content_hash], span.content_hash in found) for span in media], busy_s

    async def _encode_mine(self, mine: tuple[MediaSpan, ...], shapes: dict[int, tuple[int, int]]) -> float:
        """Decode, then encode in the next batch, the images this call is the first to bring; the seconds spent."""
        started = time.perf_counter()
        try:
            prepared = await asyncio.to_thread(self.vision.prepare, mine)
            decoded_s = time.perf_counter() - started
            waiting = _Waiting(mine, prepared)
            self._waiting.append(waiting)
            self._wake.set()
            features = await waiting.done
        except BaseException:
            # Calls waiting on these images encode them themselves: this call's failure (one of its images bad,
            # its client gone) is its own.
            for span in mine:
                future = self._in_flight.pop(span.content_hash)
                future.set_exception(GaveUp())
                future.exception()  # retrieved here: no warning when no call waits on it
            raise
        for span in mine:
            shapes[span.content_hash] = tuple(features[span.content_hash].shape)
            self._in_flight.pop(span.content_hash).set_result(shapes[span.content_hash])
        return decoded_s + waiting.forward_s

    def held(self, content_hash: int) -> tuple[int, int, str, memoryview] | None:
        """The cached output of an image as (rows, hidden, dtype, its bytes on the host), for a prefill worker's
        pull; None once evicted. Blocking (a device copy): called on a thread."""
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
                    waiting = self._waiting.pop(0)
                    if not waiting.done.done():  # its caller left: nothing to encode for it
                        batch.append(waiting)
                        images += len(waiting.media)
                if batch:
                    await self._run(batch)

    async def _run(self, batch: list[_Waiting]) -> None:
        spans = list({span.content_hash: span for w in batch for span in w.media}.values())
        merged = PreparedMedia()
        for w in batch:
            merged.pixels.update(w.prepared.pixels)
        self.num_running = len(spans)
        started = time.perf_counter()
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
        forward_s = time.perf_counter() - started
        for w in batch:
            if w.done.done():
                continue  # its caller left
            w.forward_s = forward_s * len(w.media) / len(spans)  # its share of the forward
            if isinstance(features, Exception):
                w.done.set_exception(features)
            else:
                w.done.set_result(features)

    def _stopped(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:  # Encode calls would wait for ever: say why
            logger.error("the encode batch loop failed: %r", task.exception())
