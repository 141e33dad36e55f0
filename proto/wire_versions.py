"""This release's number and the versions of each wire format it reads and writes, shared by both ends.

The promise (docs/operating/upgrades.md): every process of release N works with every process of release N-1 in
both directions. So a process that announces no versions (a release before they were announced) is taken to be
the previous release, and a format a process does not name is read as the previous release's range for it.
A new version of a format is written only once every peer that reads it reads that version: a pair uses the
newest version both ends read (`FormatRange.common_newest`), and a cluster-wide format the newest every
registered process reads (coordinator/cluster/wire_formats.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from proto import worker_pb2 as pb

# Kept equal to pyproject.toml's version (a test checks): a process run from a source tree reports its own.
RELEASE = "0.2.0"
PREVIOUS_RELEASE = "0.1.0"  # commit 0e52718: the first release the promise covers


@dataclass(frozen=True)
class FormatRange:
    """The versions of one wire format a process reads and writes: `oldest` to `newest`, both included."""

    oldest: int
    newest: int

    def common_newest(self, other: FormatRange) -> int | None:
        """The newest version both read; None when they share none (such a pair is never made)."""
        newest = min(self.newest, other.newest)
        return newest if newest >= max(self.oldest, other.oldest) else None


# Each wire's formats, by name; a new version of a wire's format is added here and to the table on
# docs/operating/upgrades.md, and written only where `common_newest` or the cluster's active version allows it.
FORMATS: Mapping[str, FormatRange] = {
    "kv_layout": FormatRange(2, 2),        # KvHeader.kv_layout_version: token-major tensors
    # 2: DecodeRequest.draft_hints and no_drafts (speculative decoding); 3: held_text_tokens (a continued stream's
    # text held back by the worker it left)
    "decode_request": FormatRange(1, 3),
    "token_records": FormatRange(1, 1),    # the token channel's frames (proto/token_channel.py)
    "kv_events": FormatRange(1, 1),        # KvEvents.Watch's stored/removed/cleared events
    "etcd_records": FormatRange(1, 1),     # instance, leadership and replica records coordinators keep in etcd
    # 1: MediaItem.encoder (a prefill worker pulls an image's encoder output from an encode worker); 0: reads none
    "embeddings": FormatRange(0, 1),
}
# DecodeRequest.held_text_tokens' bound (decode request format 3), checked by the worker, kept to by the coordinator:
# a character's bytes or a stop string's prefix, never more.
MAX_HELD_TEXT_TOKENS = 256

PREVIOUS_FORMATS: Mapping[str, FormatRange] = {**FORMATS, "decode_request": FormatRange(1, 1),
                                               "embeddings": FormatRange(0, 0)}


@dataclass(frozen=True)
class WireVersions:
    """A process's release and the formats it announced; `range` answers for any format."""

    release: str
    formats: Mapping[str, FormatRange] = field(default_factory=dict)
    announced: bool = True  # False: it announced nothing (a release before announcements), taken as the previous

    def range(self, name: str) -> FormatRange:
        return self.formats.get(name) or PREVIOUS_FORMATS.get(name) or FormatRange(1, 1)

    def describe(self) -> dict:
        return {"release": self.release, "announced": self.announced,
                "formats": {name: [r.oldest, r.newest] for name, r in sorted(self.formats.items())}}


THIS_PROCESS = WireVersions(RELEASE, FORMATS)
PREVIOUS = WireVersions(PREVIOUS_RELEASE, PREVIOUS_FORMATS, announced=False)


def release_key(release: str) -> tuple[int, ...]:
    """A release number as a comparable tuple ("0.10.0" after "0.9.1"); an unreadable part counts as 0."""
    return tuple(int(part) if part.isdigit() else 0 for part in release.split("."))


def add_to_health(health: pb.HealthResponse) -> pb.HealthResponse:
    """This process's release and formats announced in its health answer."""
    health.release = RELEASE
    for name, versions in FORMATS.items():
        health.wire_formats.add(name=name, oldest=versions.oldest, newest=versions.newest)
    return health


def from_health(health: pb.HealthResponse) -> WireVersions:
    """What a worker announced in its health answer; nothing announced: the previous release."""
    if not health.release:
        return PREVIOUS
    return WireVersions(health.release, {f.name: FormatRange(f.oldest, f.newest) for f in health.wire_formats})
