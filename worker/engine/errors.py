"""Why an engine refuses or ends a request (besides KvCapacityError and KvTransferError); the servicers
map each to one gRPC status."""

from __future__ import annotations


class DuplicateRequestError(ValueError):
    """A request id that is already on this worker."""


class RequestFailed(Exception):
    """The worker failed the request itself (a forward raised)."""
