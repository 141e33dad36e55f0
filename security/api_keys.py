"""API keys kept as SHA-256 digests: the file format, and the check of a request's Authorization header.

The file holds one lowercase hex SHA-256 digest per line (`printf %s "$KEY" | sha256sum` makes one); blank
lines and `#` comments, whole-line or after a digest, are allowed. The keys themselves are never stored.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from pathlib import Path

from security.secrets import bearer_value

MISSING = "missing"  # no Authorization header, or an empty one
MALFORMED = "malformed"  # `Bearer` with no key, or a scheme other than Bearer
INVALID = "invalid"  # a key whose digest is not in the file
FAILURE_REASONS = (MISSING, MALFORMED, INVALID)

_DIGEST = re.compile(r"[0-9a-f]{64}\Z")


class ApiKeyFileError(ValueError):
    """The API keys file cannot be read or has a line that is not a digest; names the file and line, never its text."""


def hash_key(key: str) -> str:
    """The line the keys file holds for `key`: the lowercase hex SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def read_digests(path: Path | str) -> tuple[bytes, ...]:
    """The digests in the keys file at `path`, in file order without repeats."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ApiKeyFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ApiKeyFileError(f"{path}: not UTF-8 text") from None
    digests: dict[bytes, None] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        if not _DIGEST.match(entry):
            # The line may be a key pasted by mistake: say what is wrong with it, never what it holds.
            raise ApiKeyFileError(f"{path}: line {number}: not a SHA-256 digest (64 lowercase hex characters); "
                                  "the file holds digests of keys, never the keys")
        digests[bytes.fromhex(entry)] = None
    return tuple(digests)


class ApiKeyStore:
    """The accepted keys' digests, read from one file and re-read on `reload()`."""

    def __init__(self, path: Path | str, digests: tuple[bytes, ...]):
        self.path = Path(path)
        self._digests = digests

    @classmethod
    def load(cls, path: Path | str) -> ApiKeyStore:
        """The store of the file at `path`; ApiKeyFileError if it cannot be read or a line is not a digest."""
        return cls(path, read_digests(path))

    @property
    def num_keys(self) -> int:
        return len(self._digests)

    def reload(self) -> int:
        """Re-read the file and return its number of keys; on ApiKeyFileError the keys in use stay as they were."""
        self._digests = read_digests(self.path)
        return len(self._digests)

    def check(self, authorization: str | None) -> str | None:
        """None if the header carries an accepted key (`Bearer <key>` or a bare `<key>`), else why not:
        MISSING, MALFORMED or INVALID."""
        if not (authorization or "").strip():
            return MISSING
        value = bearer_value(authorization)
        if not value or any(c.isspace() for c in value):
            return MALFORMED
        # aiohttp decodes header bytes that are not UTF-8 with surrogateescape: hash the bytes as sent.
        presented = hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()
        # Compare with every digest, no early exit: the time taken says nothing about which one matched.
        accepted = False
        for digest in self._digests:
            accepted |= hmac.compare_digest(presented, digest)
        return None if accepted else INVALID
