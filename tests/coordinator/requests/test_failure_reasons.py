"""Each FailureReason a worker gives reaches the coordinator, in a gRPC call's trailing metadata and in a token
channel's error event, and is what the failure is classified by, whatever its message says (in-process servers)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from coordinator.requests.failures import FailureKind, WorkerCallError
from coordinator.requests.request import GenerationRequest, SamplingOptions
from coordinator.workers.client import ChannelDecodeStream, DecodeStream, WorkerClient
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from proto.failure_reason import reason_metadata
from tests.helpers import token_channel_opens
from worker.service.token_channel import ChannelCallContext, TokenChannelListener, serve_as_call

# (stage, status code, reason, the kind the coordinator must make of it)
REASONS = [
    ("decode", grpc.StatusCode.DEADLINE_EXCEEDED, pb.FAILURE_REASON_KV_NOT_RECEIVED, FailureKind.KV_NOT_RECEIVED),
    ("decode", grpc.StatusCode.DATA_LOSS, pb.FAILURE_REASON_KV_CORRUPT, FailureKind.KV_NOT_RECEIVED),
    ("decode", grpc.StatusCode.UNAVAILABLE, pb.FAILURE_REASON_DRAINING, FailureKind.WORKER_GONE),
    ("decode", grpc.StatusCode.DEADLINE_EXCEEDED, pb.FAILURE_REASON_CALL_DEADLINE, FailureKind.DEADLINE),
    ("decode", grpc.StatusCode.ABORTED, pb.FAILURE_REASON_PREEMPTED, FailureKind.MOVED),
    ("prefill", grpc.StatusCode.UNAVAILABLE, pb.FAILURE_REASON_KV_SEND_FAILED, FailureKind.KV_SEND_FAILED),
    ("prefill", grpc.StatusCode.DEADLINE_EXCEEDED, pb.FAILURE_REASON_KV_LEASE_EXPIRED, FailureKind.WORKER_FAULT),
    ("prefill", grpc.StatusCode.UNAVAILABLE, pb.FAILURE_REASON_DRAINING, FailureKind.WORKER_GONE),
    ("prefill", grpc.StatusCode.DEADLINE_EXCEEDED, pb.FAILURE_REASON_CALL_DEADLINE, FailureKind.WORKER_FAULT),
    ("decode", grpc.StatusCode.UNAVAILABLE, pb.FAILURE_REASON_LORA_UNAVAILABLE, FailureKind.ELSEWHERE),
    ("prefill", grpc.StatusCode.UNAVAILABLE, pb.FAILURE_REASON_LORA_UNAVAILABLE, FailureKind.ELSEWHERE),
    ("prefill", grpc.StatusCode.FAILED_PRECONDITION, pb.FAILURE_REASON_EMBEDDINGS_UNAVAILABLE,
     FailureKind.EMBEDDINGS_LOST),
]
# Messages that once decided the kind, and ones that never did: none may change it now.
MESSAGES = ["Deadline Exceeded", "sending KV to decode worker d:1: reset", "whatever the worker says"]


def test_every_reason_but_unspecified_is_covered_here():
    assert {reason for _, _, reason, _ in REASONS} == set(pb.FailureReason.values()) - {0}


class AbortingServicer(pb_grpc.DecodeServiceServicer, pb_grpc.PrefillServiceServicer):
    """Ends every Decode and Prefill call as a worker does: a status, a message, the reason in trailing metadata."""

    def __init__(self, code: grpc.StatusCode, details: str, reason: int):
        self.code, self.details, self.reason = code, details, reason

    async def Decode(self, request, context):
        await context.abort(self.code, self.details, trailing_metadata=reason_metadata(self.reason))
        yield  # an async generator, as a streaming servicer is

    async def Prefill(self, request, context):
        await context.abort(self.code, self.details, trailing_metadata=reason_metadata(self.reason))


@contextlib.asynccontextmanager
async def grpc_worker(servicer):
    server = grpc.aio.server()
    pb_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    pb_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@contextlib.asynccontextmanager
async def channel_worker(kind: str, code: grpc.StatusCode, details: str, reason: int, seen: list | None = None):
    """A worker's token channel listener whose every request ends as the servicers end one on a channel (each
    request appended to `seen` first)."""
    async def serve(channel, request, timeout_s):
        if seen is not None:
            seen.append(request)
        async def work():
            await ChannelCallContext().abort(code, details, trailing_metadata=reason_metadata(reason))

        await serve_as_call(channel, kind, request.request_id, timeout_s, work())

    listener = TokenChannelListener(serve, pb.HealthResponse, kind=kind)
    port = await listener.start("127.0.0.1")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await listener.stop()


async def fail_one_call(client: WorkerClient, address: str, stage: str, via: type):
    request = GenerationRequest("r-1", [1, 2, 3], SamplingOptions(), 4)
    with pytest.raises(WorkerCallError) as failed:
        if stage == "decode":
            stream = client.open_decode(address, request, 4, 64, 5.0)
            assert isinstance(stream, via)
            try:
                await stream.read()
            finally:
                stream.cancel()
        else:
            await client.prefill(address, request, 4, "d:1", 5.0)
    return failed.value.failure


@pytest.mark.parametrize("details", MESSAGES)
@pytest.mark.parametrize(("stage", "code", "reason", "kind"), REASONS)
async def test_a_reason_in_a_calls_trailing_metadata_is_what_the_failure_is_classified_by(
        stage, code, reason, kind, details):
    client = WorkerClient()
    try:
        async with grpc_worker(AbortingServicer(code, details, reason)) as address:
            failure = await fail_one_call(client, address, stage, DecodeStream)
    finally:
        await client.close()
    assert (failure.stage, failure.code, failure.details, failure.reason) == (stage, code.name, details, reason)
    assert failure.kind is kind


@pytest.mark.parametrize("details", MESSAGES)
@pytest.mark.parametrize(("stage", "code", "reason", "kind"), REASONS)
async def test_a_reason_in_a_channels_error_event_is_what_the_failure_is_classified_by(
        stage, code, reason, kind, details):
    client = WorkerClient()
    try:
        async with channel_worker(stage, code, details, reason) as listener:
            client.token_channels.learn("w:1", listener, stage)
            await token_channel_opens(client, "w:1")
            failure = await fail_one_call(client, "w:1", stage, ChannelDecodeStream)
    finally:
        await client.close()
    assert (failure.stage, failure.code, failure.details, failure.reason) == (stage, code.name, details, reason)
    assert failure.kind is kind


async def test_a_call_without_a_reason_is_classified_by_its_status_code_alone():
    client = WorkerClient()
    try:
        async with grpc_worker(AbortingServicer(grpc.StatusCode.DEADLINE_EXCEEDED, "KV cache did not arrive",
                                                pb.FAILURE_REASON_UNSPECIFIED)) as address:
            failure = await fail_one_call(client, address, "decode", DecodeStream)
    finally:
        await client.close()
    assert failure.reason == pb.FAILURE_REASON_UNSPECIFIED and failure.kind is FailureKind.DEADLINE


@pytest.mark.parametrize("worker_deadline_s, client_timeout_s", [(0, 0.2), (0.1, 30)],
                         ids=["the-coordinators-own-clock", "the-workers-deadline"])
async def test_a_channel_request_past_its_deadline_ends_as_its_call_deadline(worker_deadline_s, client_timeout_s):
    """Whichever clock runs out first, the coordinator's or the worker's, the failure is the call's deadline."""
    async def serve(channel, request, timeout_s):
        await serve_as_call(channel, "decode", request.request_id, worker_deadline_s, asyncio.Event().wait())

    listener = TokenChannelListener(serve, pb.HealthResponse)
    port = await listener.start("127.0.0.1")
    client = WorkerClient()
    try:
        client.token_channels.learn("w:1", f"127.0.0.1:{port}")
        await token_channel_opens(client, "w:1")
        stream = client.open_decode("w:1", GenerationRequest("r-1", [1, 2, 3], SamplingOptions(), 4), 4, 64,
                                    client_timeout_s)
        with pytest.raises(WorkerCallError) as failed:
            await stream.read()
        failure = failed.value.failure
        assert (failure.code, failure.reason) == ("DEADLINE_EXCEEDED", pb.FAILURE_REASON_CALL_DEADLINE)
        assert failure.kind is FailureKind.DEADLINE
    finally:
        await client.close()
        await listener.stop()
