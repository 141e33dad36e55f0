"""One mapping from the engines' exceptions to gRPC status codes, for every servicer and backend."""

from __future__ import annotations

import contextlib

import grpc

from kv_transfer.base import KvTransferError
from worker.engine.errors import DuplicateRequestError, InvalidRequest, RequestFailed
from worker.engine.kv_budget import KvCapacityError

STATUS_CODES: dict[type[Exception], grpc.StatusCode] = {
    KvCapacityError: grpc.StatusCode.RESOURCE_EXHAUSTED,  # can never fit: retrying elsewhere cannot help
    DuplicateRequestError: grpc.StatusCode.ALREADY_EXISTS,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,  # the coordinator answers the client 400
    KvTransferError: grpc.StatusCode.DATA_LOSS,  # the KV cache was corrupt, truncated or late
    RequestFailed: grpc.StatusCode.INTERNAL,
}


async def abort_with(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """End the RPC with the status code of `exc` (INTERNAL for anything unmapped) and its message."""
    code = next((code for kind, code in STATUS_CODES.items() if isinstance(exc, kind)), grpc.StatusCode.INTERNAL)
    await context.abort(code, str(exc))


@contextlib.asynccontextmanager
async def engine_errors_as_status(context: grpc.aio.ServicerContext):
    """Turn a mapped engine exception raised inside into the RPC's status; others pass through."""
    try:
        yield
    except tuple(STATUS_CODES) as exc:
        await abort_with(context, exc)
