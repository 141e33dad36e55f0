"""Why an engine refuses or ends a request (besides KvCapacityError and KvTransferError); the servicers
map each to one gRPC status."""

from __future__ import annotations


class DuplicateRequestError(ValueError):
    """A request id that is already on this worker."""


class InvalidRequest(ValueError):
    """The request asks for what this worker cannot do: a grammar that does not compile, replayed tokens
    outside it, a logit_bias id outside the vocabulary, guided decoding on a backend without a tokenizer."""


class SequencePreempted(Exception):
    """The pool ran dry and the sequence cannot be recomputed here (its images are not on this worker): the
    coordinator continues it on other workers."""


class EmbeddingsUnavailable(Exception):
    """An image's encoder output could not be pulled from the encode worker the coordinator named (gone, evicted
    since, or a stream refused): the coordinator sends the image's file instead."""


class RequestFailed(Exception):
    """The worker failed the request itself (a forward raised)."""
