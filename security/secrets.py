"""Shared secrets kept in files (the registration token, the worker secret), compared in constant time."""

from __future__ import annotations

import hmac
from pathlib import Path


class SecretError(Exception):
    """A secret file that cannot be used; the message names the config key and the file (never the secret)."""


def bearer_value(header: str | None) -> str | None:
    """The credential of `Authorization: Bearer <x>` (any case of Bearer) or a bare `Authorization: <x>`;
    None when absent or empty. Whitespace left inside it means another scheme or extra words."""
    value = (header or "").strip()
    if not value:
        return None
    scheme, *rest = value.split(None, 1)
    if scheme.lower() == "bearer":
        value = rest[0] if rest else ""
    return value or None


class SecretFile:
    """A secret read from a file (its first line), re-readable on SIGHUP."""

    def __init__(self, key: str, path: str):
        self.key = key
        self.path = path
        self._value = self._read()

    def _read(self) -> bytes:
        try:
            text = Path(self.path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SecretError(f"{self.key}: cannot read {self.path}: {getattr(exc, 'strerror', None) or exc}") from None
        value = text.strip().splitlines()[0].strip() if text.strip() else ""
        if len(value) < 16:
            raise SecretError(f"{self.key}: {self.path} must hold a secret of at least 16 characters")
        return value.encode()

    @property
    def name(self) -> str:
        return self.key

    def reload(self) -> None:
        self._value = self._read()

    @property
    def value(self) -> str:
        return self._value.decode()

    def matches(self, presented: str | None) -> bool:
        """Constant-time comparison with what a caller presented."""
        # surrogateescape: aiohttp hands over undecodable header bytes that way; they must compare, not raise.
        return presented is not None and hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), self._value)


def secret_file(key: str, path: str) -> SecretFile | None:
    """The secret at `path`, or None when the setting is empty."""
    return SecretFile(key, path) if path else None
