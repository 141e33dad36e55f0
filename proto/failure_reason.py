"""A failed call's FailureReason (worker.proto) in gRPC trailing metadata, as a worker sets it and the coordinator
reads it; a token channel carries it in ChannelError.reason instead."""

from __future__ import annotations

from proto import worker_pb2 as pb

FAILURE_REASON_KEY = "pdserve-failure-reason"


def reason_metadata(reason: int) -> tuple[tuple[str, str], ...]:
    """Trailing metadata that carries `reason` (the value's name); none for UNSPECIFIED."""
    return ((FAILURE_REASON_KEY, pb.FailureReason.Name(reason)),) if reason else ()


def reason_from_metadata(metadata) -> int:
    """The FailureReason in a call's trailing metadata; UNSPECIFIED when it carries none, or one this side does
    not know (a newer worker's: its status code then says what it can)."""
    for key, value in metadata or ():
        if key == FAILURE_REASON_KEY:
            try:
                return pb.FailureReason.Value(value)
            except ValueError:
                break
    return pb.FAILURE_REASON_UNSPECIFIED
