"""A vision-language model's image side on a worker: decode and preprocess an image (its processor), run the vision
tower and projector, and keep the output by content hash so an image seen again is not encoded again.

Life cycle of one image of a prompt:
1. `prepare` (off the event loop, before the request is admitted): the file decodes as a jpg or png within the
   pixel bound, and the processor gives it as many positions as the coordinator laid placeholders for; its pixel
   values stay with the request (`PreparedMedia`) until its forward. An image the encoder cache holds is skipped.
2. `embeddings` (the engine thread, before a forward in which a chunk computes any of its positions): the
   request's own output, the encoder cache's, or the vision tower's on its pixel values (decoded again if the
   cache dropped it since step 1), stored in both. The engine does this per request, so an image that fails
   fails its own request only.
3. The runner scatters the rows a chunk covers into its input embeddings; positions the prefix cache held are
   never computed, so an image wholly cached is never encoded.
"""

from __future__ import annotations

import io
import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from PIL import Image, UnidentifiedImageError

from kv_events.block_hash import ROOT_HASH
from kv_transfer.codec import DTYPE_NAMES
from kv_transfer.embeddings import EmbeddingsShape
from worker.engine.errors import EmbeddingsUnavailable, InvalidRequest
from worker.engine.media import MediaSpan

IMAGE_FORMATS = ("JPEG", "PNG")
PREFILL_CACHE_IMAGES = 32  # a prefill (or decode) worker's encoder cache: its memory is for KV


class EncoderCache:
    """Vision tower outputs by content hash, least recently used dropped first; 0 entries = off. On an encode worker
    its changes are KV events (`registered_blocks`, a `listener`, as the block pool's), one per image."""

    block_size = 1  # an event stands for one image, whatever its rows

    def __init__(self, max_items: int):
        self.max_items = max_items
        self._items: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.listener = None  # a KvEventLog: hears of every image stored and removed
        self.tier = None  # no KV tier behind it
        self._lock = threading.Lock()  # a snapshot (the event loop) against a put (an engine thread)

    def get(self, content_hash: int) -> torch.Tensor | None:
        with self._lock:
            found = self._items.get(content_hash)
            if found is None:
                self.misses += 1
                return None
            self._items.move_to_end(content_hash)
            self.hits += 1
            return found

    def put(self, content_hash: int, features: torch.Tensor) -> None:
        if self.max_items <= 0:
            return
        with self._lock:
            if content_hash not in self._items and self.listener is not None:
                self.listener.stored(content_hash, ROOT_HASH, features.shape[0])
            self._items[content_hash] = features
            self._items.move_to_end(content_hash)
            while len(self._items) > self.max_items:
                evicted, _ = self._items.popitem(last=False)
                if self.listener is not None:
                    self.listener.removed(evicted)

    def registered_blocks(self, listener=None) -> list[tuple[int, int, int]]:
        """(hash, parent, medium) of every image held, as KvEventLog's snapshot reads a block pool's; with
        `listener`, it hears of every change from now on (one atomic step, as the block pool's)."""
        with self._lock:
            if listener is not None:
                self.listener = listener
            return [(h, ROOT_HASH, 0) for h in self._items]

    def __contains__(self, content_hash: int) -> bool:
        return content_hash in self._items

    def __len__(self) -> int:
        return len(self._items)


def decode_image(span: MediaSpan) -> Image.Image:
    """The span's file as an RGB image; InvalidRequest (naming its field) if it is not a jpg or png that decodes
    within PIL's decompression-bomb bound."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(span.data))
            image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError,
            Image.DecompressionBombWarning) as exc:
        raise InvalidRequest(f"{span.name}: cannot decode the image: {exc}") from None
    if image.format not in IMAGE_FORMATS:
        raise InvalidRequest(f"{span.name}: image type {image.format} is not one of jpg, png")
    return image.convert("RGB")


@dataclass
class PreparedMedia:
    """One request's images as its forwards need them: pixel values of those the encoder cache lacked when it was
    checked, and the encoder output once computed (so an image split across chunks is encoded once)."""

    pixels: dict[int, torch.Tensor] = field(default_factory=dict)
    features: dict[int, torch.Tensor] = field(default_factory=dict)


class VisionEncoder:
    """A model's image encoder (`get_image_features`) behind its image processor and an encoder cache."""

    def __init__(self, model, processor, device: torch.device, cache_items: int = PREFILL_CACHE_IMAGES):
        self.model = model
        self.processor = processor
        self.image_processor = processor.image_processor
        self.device = device
        self.cache = EncoderCache(cache_items)
        self._lock = threading.Lock()  # `prepare` runs on the event loop's threads, `embeddings` on the engine's

    def positions_for(self, image: Image.Image) -> int:
        """Placeholder positions the processor gives an image of this size."""
        counted = self.processor._get_num_multimodal_tokens(image_sizes=[(image.height, image.width)])
        return int(counted["num_image_tokens"][0])

    @property
    def embeddings_dtype(self) -> str:
        return DTYPE_NAMES.get(self.model.dtype, str(self.model.dtype))

    def shape_for(self, span: MediaSpan) -> EmbeddingsShape:
        """The encoder output this model takes for `span`: a row per placeholder, the language model's width."""
        return EmbeddingsShape(span.num_tokens, self.model.config.get_text_config().hidden_size,
                               self.embeddings_dtype)

    def cached(self, content_hash: int) -> torch.Tensor | None:
        """The cache's output for an image, counted as a hit and made most recent; None (not counted: the miss is
        counted where it is encoded) when it is not held."""
        with self._lock:
            return self.cache.get(content_hash) if content_hash in self.cache else None

    def wanted(self, media: Sequence[MediaSpan]) -> tuple[list[tuple[MediaSpan, EmbeddingsShape]], dict]:
        """Items naming an encode worker whose output the cache lacks, with their shapes (what to pull), and the
        outputs it holds for the others, taken now (the cache may drop them before the request's forward)."""
        to_pull, held, seen = [], {}, set()
        for span in media:
            if span.encoder and span.content_hash not in seen:
                seen.add(span.content_hash)
                found = self.cached(span.content_hash)
                if found is None:
                    to_pull.append((span, self.shape_for(span)))
                else:
                    held[span.content_hash] = found
        return to_pull, held

    def prepare(self, media: Sequence[MediaSpan], pulled: dict | None = None) -> PreparedMedia:
        """Decode and preprocess every image the encoder cache lacks, and take the outputs of those naming an
        encode worker (`pulled`: bytes pulled from it, kept in the cache too, or the cache's own taken by
        `wanted`); InvalidRequest for a bad one."""
        prepared = PreparedMedia()
        for span in media:
            if span.encoder:
                prepared.features[span.content_hash] = self._adopt(span, (pulled or {}).get(span.content_hash))
                continue
            with self._lock:
                if span.content_hash in self.cache or span.content_hash in prepared.pixels:
                    continue
            image = decode_image(span)
            try:
                positions = self.positions_for(image)
                pixels = self._pixels(image)
            except (ValueError, TypeError, RuntimeError, MemoryError) as exc:
                raise InvalidRequest(f"{span.name}: the model's processor cannot take this image: {exc}") from None
            if positions != span.num_tokens:
                raise InvalidRequest(f"{span.name}: the model gives this image {positions} positions, but the "
                                     f"prompt holds {span.num_tokens} placeholders for it")
            prepared.pixels[span.content_hash] = pixels
        return prepared

    def _adopt(self, span: MediaSpan, data: bytearray | torch.Tensor | None) -> torch.Tensor:
        """A pulled output (bytes whose shape was checked on receipt) as this model's tensor, cached; or the
        cache's own, taken when the pull was planned (`wanted`)."""
        if isinstance(data, torch.Tensor):
            return data
        if data is None:
            raise EmbeddingsUnavailable(f"{span.name}: its embeddings were neither pulled nor held here")
        shape = self.shape_for(span)
        features = torch.frombuffer(data, dtype=self.model.dtype).view(shape.rows, shape.hidden).to(self.device)
        with self._lock:
            self.cache.put(span.content_hash, features)
        return features

    def _pixels(self, image: Image.Image) -> torch.Tensor:
        return self.image_processor(images=[image], return_tensors="pt")["pixel_values"]

    @torch.inference_mode()
    def embeddings(self, spans: Sequence[MediaSpan], prepared: PreparedMedia) -> dict[int, torch.Tensor]:
        """Each span's encoder output [num_tokens, hidden] on the device, by content hash: the request's own, the
        encoder cache's, or encoded now (the misses in one vision forward)."""
        span_of = {span.content_hash: span for span in spans}
        found: dict[int, torch.Tensor] = {}
        missing: dict[int, torch.Tensor | None] = {}
        with self._lock:
            for h in span_of:
                own = prepared.features.get(h)
                if own is None:
                    own = self.cache.get(h)
                if own is not None:
                    found[h] = prepared.features[h] = own
                else:
                    missing[h] = prepared.pixels.pop(h, None)
        for h, pixels in missing.items():
            if pixels is None:  # cached when checked, evicted since: decoded again from its file
                missing[h] = self._pixels(decode_image(span_of[h]))
        if missing:
            pixels = torch.cat(list(missing.values())).to(self.device, self.model.dtype)
            features = self.model.model.get_image_features(pixel_values=pixels).pooler_output
            if isinstance(features, torch.Tensor) and features.dim() == 2:  # all images' rows in one tensor
                features = features.split([span_of[h].num_tokens for h in missing])
            with self._lock:
                for h, feats in zip(missing, features):
                    feats = feats.clone()  # its own storage: a view would keep the whole batch's output alive
                    found[h] = prepared.features[h] = feats
                    self.cache.put(h, feats)
        for h, span in span_of.items():
            if found[h].shape[0] != span.num_tokens:
                raise InvalidRequest(f"{span.name}: the encoder gave {found[h].shape[0]} rows for {span.num_tokens} "
                                     "placeholders")
        return found
