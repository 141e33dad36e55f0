"""A prompt's media as the engine sees it: where each item's encoder output goes in the prompt, and its identity
(no torch).

The coordinator fetched each item, hashed it and laid its placeholder ids into the prompt. A prefill (or a local
prefill) gets the encoded file too; a decode worker fed by a transfer gets the identity only, which is all its
prefix cache needs: the image lives in the KV of the placeholder positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kv_events.block_hash import HASH_BYTES, hash_from_bytes, media_cache_tokens, media_content_hash
from worker.engine.errors import InvalidRequest

MEDIA_KINDS = ("image",)


@dataclass(frozen=True, eq=False)
class MediaSpan:
    """One media item of a prompt: placeholder positions [offset, offset + num_tokens), filled by its encoder
    output; `data` is the encoded file, b"" where only its identity came."""

    kind: str
    content_hash: int
    offset: int
    num_tokens: int
    data: bytes = b""
    source: str = ""  # the client's field it came from, for error messages
    encoder: str = ""  # the encode worker holding its encoder output (pulled instead of encoding `data`)

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    @property
    def name(self) -> str:
        return self.source or f"{self.kind} at position {self.offset}"


def spans_from_pb(items: Sequence, prompt_len: int, with_data: bool) -> tuple[MediaSpan, ...]:
    """A request's MediaItems, checked: known kinds, 16-byte hashes, in prompt order inside the prompt without
    overlapping; with `with_data`, each carries the file its hash names, or names the encode worker holding its
    encoder output."""
    spans: list[MediaSpan] = []
    for i, item in enumerate(items):
        where = item.source or f"media.{i}"
        if item.kind not in MEDIA_KINDS:
            raise InvalidRequest(f"{where}: media kind {item.kind!r} is not one of {list(MEDIA_KINDS)}")
        if len(item.content_hash) != HASH_BYTES:
            raise InvalidRequest(f"{where}: content_hash must be {HASH_BYTES} bytes, got {len(item.content_hash)}")
        low = spans[-1].end if spans else 0
        if item.num_tokens <= 0 or item.offset < low or item.offset + item.num_tokens > prompt_len:
            raise InvalidRequest(f"{where}: placeholder span [{item.offset}, {item.offset + item.num_tokens}) must "
                                 f"be non-empty, after the previous item's (from {low}) and inside the prompt of "
                                 f"{prompt_len} tokens")
        content_hash = hash_from_bytes(item.content_hash)
        if with_data and item.encoder and not item.data:
            spans.append(MediaSpan(item.kind, content_hash, item.offset, item.num_tokens, b"", item.source,
                                   item.encoder))
            continue
        if with_data and media_content_hash(item.data) != content_hash:
            raise InvalidRequest(f"{where}: its data does not match its content_hash" if item.data
                                 else f"{where}: the {item.kind}'s data is missing")
        spans.append(MediaSpan(item.kind, content_hash, item.offset, item.num_tokens,
                               item.data if with_data else b"", item.source))
    return tuple(spans)


def refuse_media(media: Sequence[MediaSpan], model_name: str) -> None:
    """A text model's answer to media: InvalidRequest naming the first item."""
    if media:
        raise InvalidRequest(f"{media[0].name}: this worker's model ({model_name}) takes no {media[0].kind} inputs")


def cache_token_ids(prompt_token_ids: list[int], media: Sequence[MediaSpan]) -> list[int]:
    """The prompt as the prefix cache hashes it (media placeholders stand for their content hash)."""
    if not media:
        return prompt_token_ids
    return media_cache_tokens(prompt_token_ids, media)
