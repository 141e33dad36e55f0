"""Engine exceptions become gRPC status codes in one place, for every servicer and backend."""

from __future__ import annotations

import grpc
import pytest

from kv_transfer.base import KvTransferError
from proto import worker_pb2 as pb
from proto.failure_reason import reason_from_metadata
from worker.engine.errors import DuplicateRequestError, RequestFailed
from worker.engine.kv_budget import KvCapacityError
from worker.service.errors import abort_with, engine_errors_as_status


class Aborted(Exception):
    pass


class RecordingContext:
    """Stands in for grpc.aio.ServicerContext: `abort` records the status and raises, as grpc's does."""

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata=()):
        self.code, self.details = code, details
        self.reason = reason_from_metadata(trailing_metadata)
        raise Aborted


@pytest.mark.parametrize("exc,code,reason", [
    (KvCapacityError("whole budget is 300 tokens"), grpc.StatusCode.RESOURCE_EXHAUSTED, pb.FAILURE_REASON_UNSPECIFIED),
    (DuplicateRequestError("request 'r' is already registered"), grpc.StatusCode.ALREADY_EXISTS,
     pb.FAILURE_REASON_UNSPECIFIED),
    (KvTransferError("checksum mismatch"), grpc.StatusCode.DATA_LOSS, pb.FAILURE_REASON_KV_CORRUPT),
    (RequestFailed("local prefill failed on the worker"), grpc.StatusCode.INTERNAL, pb.FAILURE_REASON_UNSPECIFIED),
])
async def test_engine_errors_become_one_grpc_status_and_failure_reason_each(exc, code, reason):
    context = RecordingContext()
    with pytest.raises(Aborted):
        async with engine_errors_as_status(context):
            raise exc
    assert (context.code, context.details, context.reason) == (code, str(exc), reason)


async def test_other_exceptions_pass_through_the_mapping_and_abort_as_internal():
    with pytest.raises(ValueError):
        async with engine_errors_as_status(RecordingContext()):
            raise ValueError("not an engine error")
    context = RecordingContext()
    with pytest.raises(Aborted):
        await abort_with(context, RuntimeError("boom"))
    assert (context.code, context.details) == (grpc.StatusCode.INTERNAL, "boom")
