"""A request's images, from the references a client gave to what a prefill worker needs: the files, their content
hashes, and the prompt positions each fills.

1. The API adapter validated each reference (`apis.multimodal`: kinds, the media folder, the URL list, sizes)
   and the prompt holds one placeholder token per image, where its template or list put it.
2. `MediaFetcher.fetch`: a data URL is decoded, a local file read, a listed URL fetched within `timeout_s`; every
   path is bounded to the per-item size, and the request's files together to `max_request_bytes` (they travel
   in one worker request). Each file's header must be a jpg or png, whose size the model's counts need.
3. `place_media`: each placeholder is expanded into the positions the model gives that image, and the image
   becomes a `MediaInput` (its xxh3-128 content hash stands for it in block hashes, here and on the workers).

The coordinator fetches once, so retries, migrations and the routing index all see the same bytes; the prefill
worker decodes them and runs the encoder.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import warnings
from pathlib import Path

import aiohttp
from PIL import Image, UnidentifiedImageError

from coordinator.apis.multimodal import MEDIA_RULES, MediaRef
from coordinator.errors import ApiError
from coordinator.requests.request import MediaInput
from coordinator.requests.tokenization import ImageTokens
from kv_events.block_hash import media_content_hash

MAX_REQUEST_MEDIA_BYTES = 24 * 2**20  # under the worker request frame (32 MB)
# A processor scales an image's shorter side to its input size, so a thin sliver of a few bytes would become a
# multi-gigabyte array on the prefill worker.
MAX_ASPECT_RATIO = 50
FETCH_TIMEOUT_S = 10.0
_READ_CHUNK = 1 << 16


class MediaFetcher:
    """Gets the bytes of validated media references, each bounded in size and time."""

    def __init__(self, timeout_s: float = FETCH_TIMEOUT_S, max_request_bytes: int = MAX_REQUEST_MEDIA_BYTES):
        self.timeout_s = timeout_s
        self.max_request_bytes = max_request_bytes
        self._session: aiohttp.ClientSession | None = None

    async def fetch_all(self, refs: tuple[MediaRef, ...]) -> list[bytes]:
        """Every reference's bytes, fetched together; their total bounded by `max_request_bytes` (413)."""
        files = await asyncio.gather(*(self.fetch(ref) for ref in refs))
        total = sum(len(data) for data in files)
        if total > self.max_request_bytes:
            raise ApiError(413, f"{refs[0].where.split('.')[0]}: the request's media add up to {total} bytes, more "
                                f"than the {self.max_request_bytes // 2**20} MB one request may carry")
        return files

    async def fetch(self, ref: MediaRef) -> bytes:
        limit = MEDIA_RULES[ref.kind][1]
        where = f"{ref.where}.{ref.kind}"
        if ref.ref.startswith("data:"):
            try:
                return base64.b64decode(ref.ref.partition(",")[2], validate=True)
            except (binascii.Error, ValueError):
                raise ApiError(400, f"{where}: the data URL's base64 does not decode", param=ref.where) from None
        if ref.ref.startswith(("http://", "https://")):
            return await self._download(ref.ref, where, limit)
        data = await asyncio.to_thread(_read_file, Path(ref.ref).resolve(), where, limit)
        return data

    async def _download(self, url: str, where: str, limit: int) -> bytes:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        try:
            async with self._session.get(url, allow_redirects=False) as response:
                if response.status != 200:
                    raise ApiError(400, f"{where}: fetching {url} answered HTTP {response.status}")
                if (response.content_length or 0) > limit:
                    raise ApiError(413, f"{where}: {url} is larger than {limit // 2**20} MB")
                data = bytearray()
                async for chunk in response.content.iter_chunked(_READ_CHUNK):
                    data += chunk
                    if len(data) > limit:
                        raise ApiError(413, f"{where}: {url} is larger than {limit // 2**20} MB")
                return bytes(data)
        except asyncio.TimeoutError:
            raise ApiError(400, f"{where}: fetching {url} took longer than {self.timeout_s:g}s") from None
        except aiohttp.ClientError as exc:
            raise ApiError(400, f"{where}: cannot fetch {url}: {exc.__class__.__name__}") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _read_file(path: Path, where: str, limit: int) -> bytes:
    try:
        with path.open("rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise ApiError(400, f"{where}: cannot read {path.name}: {exc.strerror}") from None
    if len(data) > limit:
        raise ApiError(413, f"{where}: file is larger than {limit // 2**20} MB")
    return data


def image_size(data: bytes, where: str) -> tuple[int, int]:
    """(width, height) from a jpg or png header; 400 naming `where` for anything else, for more pixels than PIL's
    decompression-bomb bound (Image.MAX_IMAGE_PIXELS), which the prefill worker would refuse to decode, or for
    sides further apart than MAX_ASPECT_RATIO."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                if image.format not in ("JPEG", "PNG"):
                    raise ApiError(400, f"{where}: image type {image.format} is not one of jpg, png")
                width, height = image.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ApiError(400, f"{where}: the image is too large to decode: {exc}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        raise ApiError(400, f"{where}: not a readable jpg or png image") from None
    if max(width, height) > MAX_ASPECT_RATIO * max(1, min(width, height)):
        raise ApiError(400, f"{where}: the image is {width}x{height}; its longer side may be at most "
                            f"{MAX_ASPECT_RATIO} times its shorter")
    return width, height


def place_media(prompt_ids: list[int], refs: tuple[MediaRef, ...], files: list[bytes], images: ImageTokens,
                param: str) -> tuple[list[int], tuple[MediaInput, ...]]:
    """Expand each image placeholder of `prompt_ids` (the i-th for the i-th image) into the positions the model
    gives it; return the prompt and its MediaInputs. 400 when the placeholders and the images do not pair up."""
    found = prompt_ids.count(images.token_id)
    if found != len(refs):
        raise ApiError(400, f"{param}: the prompt holds {found} image placeholders ({images.placeholder!r}) for "
                            f"{len(refs)} images; write the placeholder text only through image items", param=param)
    out: list[int] = []
    media: list[MediaInput] = []
    for token in prompt_ids:
        if token != images.token_id:
            out.append(token)
            continue
        ref, data = refs[len(media)], files[len(media)]
        source = f"{ref.where}.{ref.kind}"
        positions = images.positions(*image_size(data, source))
        media.append(MediaInput("image", data, media_content_hash(data), len(out), positions, source))
        out.extend([images.token_id] * positions)
    return out, tuple(media)


def truncate_with_media(prompt_ids: list[int], media: tuple[MediaInput, ...], keep_last: int,
                        param: str) -> tuple[list[int], tuple[MediaInput, ...]]:
    """The last `keep_last` positions of a prompt and the images wholly inside them (400 if the cut splits one)."""
    cut = max(0, len(prompt_ids) - keep_last)
    if not cut:
        return prompt_ids, media
    for m in media:
        if m.offset < cut < m.offset + m.num_tokens:
            raise ApiError(400, f"{param}: truncating to the last {keep_last} tokens would cut {m.source} in two",
                           param=param)
    kept = tuple(MediaInput(m.kind, m.data, m.content_hash, m.offset - cut, m.num_tokens, m.source)
                 for m in media if m.offset >= cut)
    return prompt_ids[cut:], kept
