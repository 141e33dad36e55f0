"""List inputs of typed items (the MindIE API, docs/compatibility.md) and OpenAI chat content parts: validated as
it says; media are refused for a text-only model, and all but images for a vision-language one.

Rules: at most 20 media items per request; a local file must lie under the configured media
folder; an http(s) URL must be listed in ALLOWED_MEDIA_URLS_ENV; sizes at most 20 MB (images,
audio) or 512 MB (video); image types jpg/jpeg/png or base64 jpg, video mp4/avi/wmv, audio
mp3/wav/flac. A list of text items only is the same as their concatenated text. Inline images are base64 data
URLs of jpg or png (OpenAI clients send both).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.errors import ApiError

MAX_MEDIA_ITEMS = 20
ALLOWED_URLS_ENV = "ALLOWED_MEDIA_URLS_ENV"
INLINE_IMAGE_PREFIXES = ("data:image/jpeg;base64,", "data:image/jpg;base64,", "data:image/png;base64,")
MEDIA_RULES = {
    "image_url": ({".jpg", ".jpeg", ".png"}, 20 * 2**20),
    "video_url": ({".mp4", ".avi", ".wmv"}, 512 * 2**20),
    "audio_url": ({".mp3", ".wav", ".flac"}, 20 * 2**20),
}


def _media_ref(item: dict, kind: str, where: str) -> str:
    ref = item.get(kind)
    if isinstance(ref, dict):  # OpenAI chat parts: {"image_url": {"url": ...}}
        ref = ref.get("url")
    if not isinstance(ref, str) or not ref:
        raise ApiError(400, f"{where}.{kind}: must be a non-empty path or URL", param=where)
    return ref


def _check_media(kind: str, ref: str, where: str, media_dir: Path) -> None:
    suffixes, max_bytes = MEDIA_RULES[kind]
    if ref.startswith("data:"):
        if kind != "image_url" or not ref.startswith(INLINE_IMAGE_PREFIXES):
            raise ApiError(400, f"{where}.{kind}: only base64-encoded jpg or png images may be sent inline",
                           param=where)
        if len(ref) * 3 // 4 > max_bytes:
            raise ApiError(413, f"{where}.{kind}: inline image is larger than {max_bytes // 2**20} MB", param=where)
        return
    if ref.startswith(("http://", "https://")):
        allowed = [u.strip() for u in os.environ.get(ALLOWED_URLS_ENV, "").split(",") if u.strip()]
        if ref not in allowed:
            raise ApiError(400, f"{where}.{kind}: URL {ref!r} is not listed in {ALLOWED_URLS_ENV}", param=where)
        return
    try:
        # Symlinks are followed before the folder check, so a link inside it cannot point outside.
        path = Path(ref).resolve()
    except (OSError, ValueError, RuntimeError):  # a NUL byte, a symlink loop: the client's fault, never a 500
        raise ApiError(400, f"{where}.{kind}: cannot resolve local path {ref!r}", param=where) from None
    if media_dir.resolve() not in path.parents:
        raise ApiError(400, f"{where}.{kind}: local files must lie under {media_dir}/, got {ref!r}", param=where)
    if path.suffix.lower() not in suffixes:
        raise ApiError(400, f"{where}.{kind}: type {path.suffix or '(none)'} is not one of {sorted(suffixes)}",
                       param=where)
    try:
        stat = path.stat() if path.is_file() else None
    except OSError:  # a name too long, a folder we may not read
        stat = None
    if stat is None:
        raise ApiError(400, f"{where}.{kind}: no such file {ref!r}", param=where)
    if stat.st_size > max_bytes:
        raise ApiError(413, f"{where}.{kind}: file is larger than {max_bytes // 2**20} MB", param=where)


@dataclass(frozen=True)
class MediaRef:
    """One validated media item of a request: its kind (`image_url`, ...), the client's path or URL, and the field
    it came in (for error messages)."""

    kind: str
    ref: str
    where: str


@dataclass(frozen=True)
class ItemsPrompt:
    """A list input, validated: its text (each image as the model's placeholder), the same as chat-template parts
    ({"type": "text"} / {"type": "image"}), and its media in order."""

    text: str
    parts: tuple[dict, ...]
    media: tuple[MediaRef, ...]


def parse_items(items: list[Any], param: str, media_dir: Path, image_placeholder: str | None = None,
                require_text: bool = True) -> ItemsPrompt:
    """Validate a list input. `image_placeholder`: the served vision-language model's image text; None (a text
    model) refuses media with a 400, and a VLM refuses video and audio by name. `require_text`: a list of media
    alone is refused (the list inputs; a chat message may be an image alone)."""
    if not items:
        raise ApiError(400, f"{param}: the list of input items must not be empty", param=param)
    texts, parts, media = [], [], []
    for i, item in enumerate(items):
        where = f"{param}.{i}"
        if not isinstance(item, dict) or not isinstance(item.get("type"), str):
            raise ApiError(400, f"{where}: each item must be an object with a `type`", param=param)
        kind = item["type"]
        if kind == "text":
            if not isinstance(item.get("text"), str) or not item["text"]:
                raise ApiError(400, f"{where}.text: must be a non-empty string", param=param)
            texts.append(item["text"])
            parts.append({"type": "text", "text": item["text"]})
        elif kind in MEDIA_RULES:
            ref = _media_ref(item, kind, where)
            _check_media(kind, ref, where, media_dir)
            media.append(MediaRef(kind, ref, where))
            if image_placeholder is not None and kind == "image_url":
                texts.append(image_placeholder)
                parts.append({"type": "image"})
        else:
            raise ApiError(400, f"{where}.type: must be one of text, image_url, video_url, audio_url; got {kind!r}",
                           param=param)
    if len(media) > MAX_MEDIA_ITEMS:
        raise ApiError(400, f"{param}: at most {MAX_MEDIA_ITEMS} image/video/audio items, got {len(media)}",
                       param=param)
    if media and image_placeholder is None:
        raise ApiError(400, f"{param}: the served model is text-only and cannot take "
                            f"{sorted({m.kind for m in media})} inputs", param=param)
    for ref in media:
        if ref.kind != "image_url":
            raise ApiError(400, f"{ref.where}.{ref.kind}: the served model takes images only, not "
                                f"{ref.kind.removesuffix('_url')}", param=param)
    if all(part["type"] != "text" for part in parts) and (require_text or not media):
        raise ApiError(400, f"{param}: at least one text item is required", param=param)
    return ItemsPrompt("".join(texts), tuple(parts), tuple(media))
