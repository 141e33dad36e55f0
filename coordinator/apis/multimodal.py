"""List inputs of typed items (the MindIE API, docs/compatibility.md): validated as it says, then refused for a
text-only model.

Rules: at most 20 media items per request; a local file must lie under the configured media
folder; an http(s) URL must be listed in ALLOWED_MEDIA_URLS_ENV; sizes at most 20 MB (images,
audio) or 512 MB (video); image types jpg/jpeg/png or base64 jpg, video mp4/avi/wmv, audio
mp3/wav/flac. A list of text items only is the same as their concatenated text.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from coordinator.errors import ApiError

MAX_MEDIA_ITEMS = 20
ALLOWED_URLS_ENV = "ALLOWED_MEDIA_URLS_ENV"
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
        if kind != "image_url" or not ref.startswith(("data:image/jpeg;base64,", "data:image/jpg;base64,")):
            raise ApiError(400, f"{where}.{kind}: only base64-encoded jpg images may be sent inline", param=where)
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


def text_of_items(items: list[Any], param: str, media_dir: Path, multimodal_model: bool = False) -> str:
    """Validate a list input; return its text, or refuse media for a text-only model with a 400."""
    if not items:
        raise ApiError(400, f"{param}: the list of input items must not be empty", param=param)
    texts, media = [], []
    for i, item in enumerate(items):
        where = f"{param}.{i}"
        if not isinstance(item, dict) or not isinstance(item.get("type"), str):
            raise ApiError(400, f"{where}: each item must be an object with a `type`", param=param)
        kind = item["type"]
        if kind == "text":
            if not isinstance(item.get("text"), str) or not item["text"]:
                raise ApiError(400, f"{where}.text: must be a non-empty string", param=param)
            texts.append(item["text"])
        elif kind in MEDIA_RULES:
            _check_media(kind, _media_ref(item, kind, where), where, media_dir)
            media.append(kind)
        else:
            raise ApiError(400, f"{where}.type: must be one of text, image_url, video_url, audio_url; got {kind!r}",
                           param=param)
    if len(media) > MAX_MEDIA_ITEMS:
        raise ApiError(400, f"{param}: at most {MAX_MEDIA_ITEMS} image/video/audio items, got {len(media)}",
                       param=param)
    if media and not multimodal_model:
        raise ApiError(400, f"{param}: the served model is text-only and cannot take {sorted(set(media))} inputs",
                       param=param)
    if not texts:
        raise ApiError(400, f"{param}: at least one text item is required", param=param)
    return "".join(texts)
