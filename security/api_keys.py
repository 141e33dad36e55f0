"""API keys kept as SHA-256 digests: the file format, and the check of a request's Authorization header.

The file holds one lowercase hex SHA-256 digest per line (`printf %s "$KEY" | sha256sum` makes one); blank
lines and `#` comments, whole-line or after a digest, are allowed. The keys themselves are never stored.
A digest may be followed by its tenant: `name=NAME weight=W rpm=N tpm=N concurrency=N`, each optional
(docs/tenants.md). Keys naming the same tenant share it; a key without a name is a tenant of its own,
`key-` and the digest's first 8 characters.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path

from security.secrets import bearer_value

MISSING = "missing"  # no Authorization header, or an empty one
MALFORMED = "malformed"  # `Bearer` with no key, or a scheme other than Bearer
INVALID = "invalid"  # a key whose digest is not in the file
FAILURE_REASONS = (MISSING, MALFORMED, INVALID)

_DIGEST = re.compile(r"[0-9a-f]{64}\Z")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
MAX_WEIGHT = 1000.0
RESERVED_NAMES = ("anonymous", "overflow")  # the tenants of requests without a key, and of the header's surplus
MAX_LIMIT = 10**9


@dataclass(frozen=True)
class TenantTerms:
    """A tenant's share and limits as the keys file states them; 0 = that limit is off."""

    name: str
    weight: float = 1.0
    rpm: int = 0  # requests per minute
    tpm: int = 0  # prompt + output tokens per minute
    concurrency: int = 0  # requests in flight (waiting or running)


def _tenant_field(field: str, value: str, where: str):
    """One `field=value` of a keys-file line, checked; ApiKeyFileError naming the line and the field."""
    if field == "name":
        if not _NAME.match(value):
            raise ApiKeyFileError(f"{where}: name must be 1-64 of A-Z a-z 0-9 . _ - (starting with a letter or "
                                  "digit)")
        if value in RESERVED_NAMES:
            raise ApiKeyFileError(f"{where}: name {value} is reserved (requests without a key, header-named "
                                  "tenants past tenancy_config.max_tenants)")
        return value
    if field == "weight":
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not 0 < weight <= MAX_WEIGHT:  # NaN fails too
            raise ApiKeyFileError(f"{where}: weight must be a number in (0, {MAX_WEIGHT:g}]")
        return weight
    if field in ("rpm", "tpm", "concurrency"):
        if not value.isdigit() or not 1 <= int(value) <= MAX_LIMIT:
            raise ApiKeyFileError(f"{where}: {field} must be a whole number in [1, {MAX_LIMIT}]")
        return int(value)
    # Not quoted: the text may be a key pasted by mistake (a base64 key ends in `=`).
    raise ApiKeyFileError(f"{where}: an unknown field; a digest may be followed by name=, weight=, rpm=, tpm=, "
                          "concurrency=")


def _tenant_terms(digest: str, words: list[str], where: str) -> TenantTerms:
    fields: dict = {}
    for word in words:
        field, sep, value = word.partition("=")
        if not sep:
            raise ApiKeyFileError(f"{where}: expected field=value after the digest")
        if field in fields:
            raise ApiKeyFileError(f"{where}: {field} is given twice")
        fields[field] = _tenant_field(field, value, where)
    fields.setdefault("name", f"key-{digest[:8]}")
    return TenantTerms(**fields)


class ApiKeyFileError(ValueError):
    """The API keys file cannot be read or has a line that is not a digest; names the file and line, never its text."""


def hash_key(key: str) -> str:
    """The line the keys file holds for `key`: the lowercase hex SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def read_keys(path: Path | str) -> dict[bytes, TenantTerms]:
    """Each digest in the keys file at `path` with its tenant's terms, in file order; keys naming one tenant
    must state the same terms (or state them on one line and only name it on the others)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ApiKeyFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ApiKeyFileError(f"{path}: not UTF-8 text") from None
    keys: dict[bytes, TenantTerms] = {}
    stated: dict[str, tuple[TenantTerms, int]] = {}  # tenant name -> its terms and the line that stated them
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{path}: line {number}"
        if not _DIGEST.match(words[0]):
            # The line may be a key pasted by mistake: say what is wrong with it, never what it holds.
            raise ApiKeyFileError(f"{where}: not a SHA-256 digest (64 lowercase hex characters); "
                                  "the file holds digests of keys, never the keys")
        terms = _tenant_terms(words[0], words[1:], where)
        if len(words) > 2 or words[1:] and not words[1].startswith("name="):  # states terms, not just a name
            earlier = stated.get(terms.name)
            if earlier is not None and earlier[0] != terms:
                raise ApiKeyFileError(f"{where}: tenant {terms.name} has other terms on line {earlier[1]}; state "
                                      "them once (other keys of the tenant may give only name=)")
            stated[terms.name] = (terms, number)
        keys[bytes.fromhex(words[0])] = terms
    # A key that only names its tenant takes the terms stated for it on another line.
    return {digest: stated.get(terms.name, (terms,))[0] for digest, terms in keys.items()}


class ApiKeyStore:
    """The accepted keys' digests, read from one file and re-read on `reload()`."""

    def __init__(self, path: Path | str, keys: dict[bytes, TenantTerms]):
        self.path = Path(path)
        self._keys = keys
        self._digests = tuple(keys)
        self._terms = tuple(keys.values())
        self._tenants = {terms.name: terms for terms in self._terms}

    @classmethod
    def load(cls, path: Path | str) -> ApiKeyStore:
        """The store of the file at `path`; ApiKeyFileError if it cannot be read or a line is not a digest."""
        return cls(path, read_keys(path))

    @property
    def num_keys(self) -> int:
        return len(self._digests)

    def tenants(self) -> dict[str, TenantTerms]:
        """Every tenant the file names, by name."""
        return self._tenants

    def reload(self) -> int:
        """Re-read the file and return its number of keys; on ApiKeyFileError the keys in use stay as they were."""
        self.__init__(self.path, read_keys(self.path))
        return len(self._digests)

    def identify(self, authorization: str | None) -> tuple[str | None, TenantTerms | None]:
        """(None, the key's tenant) if the header carries an accepted key (`Bearer <key>` or a bare `<key>`), else
        (why not: MISSING, MALFORMED or INVALID, None)."""
        if not (authorization or "").strip():
            return MISSING, None
        value = bearer_value(authorization)
        if not value or any(c.isspace() for c in value):
            return MALFORMED, None
        # aiohttp decodes header bytes that are not UTF-8 with surrogateescape: hash the bytes as sent.
        presented = hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()
        # Compare with every digest, no early exit: the time taken says nothing about which one matched.
        found = -1
        for index, digest in enumerate(self._digests):
            if hmac.compare_digest(presented, digest):
                found = index
        return (None, self._terms[found]) if found >= 0 else (INVALID, None)
