"""Synthetic tokens: a hash of the request's seed (else its id) and the token's index, so the prefill
worker's first token and the decode worker's later ones agree without a model."""

from __future__ import annotations

import xxhash


def synthetic_token(key: str, index: int, vocab_size: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{key}:{index}".encode()) % vocab_size


def token_text(token_id: int) -> str:
    return f" t{token_id}"


def token_key(request_id: str, seed: int | None) -> str:
    """What a request's tokens derive from: its seed when it has one (reproducible), else its id."""
    return f"seed={seed}" if seed is not None else request_id
