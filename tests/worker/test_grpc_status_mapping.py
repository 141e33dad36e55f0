"""Engine exceptions become gRPC status codes in one place, for every servicer and backend."""

from __future__ import annotations

import grpc
import pytest

from kv_transfer.base import KvTransferError
from worker.engine.errors import DuplicateRequestError, RequestFailed
from worker.engine.kv_budget import KvCapacityError
from worker.service.errors import abort_with, engine_errors_as_status


class Aborted(Exception):
    pass


class RecordingContext:
    """Stands in for grpc.aio.ServicerContext: `abort` records the status and raises, as grpc's does."""

    async def abort(self, code: grpc.StatusCode, details: str):
        self.code, self.details = code, details
        raise Aborted


@pytest.mark.parametrize("exc,code", [
    (KvCapacityError("whole budget is 300 tokens"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DuplicateRequestError("request 'r' is already registered"), grpc.StatusCode.ALREADY_EXISTS),
    (KvTransferError("checksum mismatch"), grpc.StatusCode.DATA_LOSS),
    (RequestFailed("local prefill failed on the worker"), grpc.StatusCode.INTERNAL),
])
async def test_engine_errors_become_one_grpc_status_each(exc, code):
    context = RecordingContext()
    with pytest.raises(Aborted):
        async with engine_errors_as_status(context):
            raise exc
    assert (context.code, context.details) == (code, str(exc))


async def test_other_exceptions_pass_through_the_mapping_and_abort_as_internal():
    with pytest.raises(ValueError):
        async with engine_errors_as_status(RecordingContext()):
            raise ValueError("not an engine error")
    context = RecordingContext()
    with pytest.raises(Aborted):
        await abort_with(context, RuntimeError("boom"))
    assert (context.code, context.details) == (grpc.StatusCode.INTERNAL, "boom")
