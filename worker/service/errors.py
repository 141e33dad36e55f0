"""One mapping from the engines' exceptions to gRPC status codes (and failure reasons), for every servicer and
backend."""

from __future__ import annotations

import contextlib

import grpc

from kv_transfer.base import KvTransferError
from proto import worker_pb2 as pb
from proto.failure_reason import reason_metadata
from worker.engine.errors import (DuplicateRequestError, EmbeddingsUnavailable, InvalidRequest, RequestFailed,
                                  SequencePreempted)
from worker.engine.kv_budget import KvCapacityError
from worker.engine.lora import LoraUnavailable

STATUS_CODES: dict[type[Exception], grpc.StatusCode] = {
    KvCapacityError: grpc.StatusCode.RESOURCE_EXHAUSTED,  # can never fit: retrying elsewhere cannot help
    DuplicateRequestError: grpc.StatusCode.ALREADY_EXISTS,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,  # the coordinator answers the client 400
    KvTransferError: grpc.StatusCode.DATA_LOSS,  # the KV cache was corrupt, truncated or late
    RequestFailed: grpc.StatusCode.INTERNAL,
    SequencePreempted: grpc.StatusCode.ABORTED,
    LoraUnavailable: grpc.StatusCode.UNAVAILABLE,  # this worker cannot load the adapter: another may
    EmbeddingsUnavailable: grpc.StatusCode.FAILED_PRECONDITION,  # the encode worker's fault: the file instead
}
# What the code alone leaves open for the coordinator: DATA_LOSS from a KV stream says the prefill side is at fault.
FAILURE_REASONS: dict[type[Exception], int] = {KvTransferError: pb.FAILURE_REASON_KV_CORRUPT,
                                               SequencePreempted: pb.FAILURE_REASON_PREEMPTED,
                                               LoraUnavailable: pb.FAILURE_REASON_LORA_UNAVAILABLE,
                                               EmbeddingsUnavailable: pb.FAILURE_REASON_EMBEDDINGS_UNAVAILABLE}


async def abort_with(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """End the RPC with the status code of `exc` (INTERNAL for anything unmapped), its failure reason and its
    message."""
    code = next((code for kind, code in STATUS_CODES.items() if isinstance(exc, kind)), grpc.StatusCode.INTERNAL)
    reason = next((reason for kind, reason in FAILURE_REASONS.items() if isinstance(exc, kind)),
                  pb.FAILURE_REASON_UNSPECIFIED)
    await context.abort(code, str(exc), trailing_metadata=reason_metadata(reason))


@contextlib.asynccontextmanager
async def engine_errors_as_status(context: grpc.aio.ServicerContext):
    """Turn a mapped engine exception raised inside into the RPC's status; others pass through."""
    try:
        yield
    except tuple(STATUS_CODES) as exc:
        await abort_with(context, exc)
