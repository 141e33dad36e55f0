"""WorkerClient's decode requests as a worker receives them, as a Decode call and on a token channel: the request's
draft hints and drafting switch (in-process servers record each DecodeRequest)."""

from __future__ import annotations

import grpc
import pytest

from coordinator.requests.failures import WorkerCallError
from coordinator.requests.request import GenerationRequest, SamplingOptions
from coordinator.workers.client import ChannelDecodeStream, DecodeStream, WorkerClient
from proto import worker_pb2 as pb
from tests.coordinator.requests.test_failure_reasons import AbortingServicer, channel_worker, grpc_worker
from tests.helpers import token_channel_opens

REFUSED = (grpc.StatusCode.UNAVAILABLE, "recorded", pb.FAILURE_REASON_UNSPECIFIED)


class RecordingServicer(AbortingServicer):
    """Records each Decode call's request, then ends it as a worker that refused it."""

    def __init__(self):
        super().__init__(*REFUSED)
        self.requests: list[pb.DecodeRequest] = []

    async def Decode(self, request, context):
        self.requests.append(request)
        async for event in super().Decode(request, context):
            yield event


async def refused_decode(client: WorkerClient, address: str, request: GenerationRequest, via: type) -> None:
    stream = client.open_decode(address, request, 4, 64, 5.0)
    assert isinstance(stream, via)
    with pytest.raises(WorkerCallError):
        await stream.read()
    stream.cancel()


async def decode_request_seen(request: GenerationRequest, via: type) -> pb.DecodeRequest:
    client, seen = WorkerClient(), []
    try:
        if via is DecodeStream:
            servicer = RecordingServicer()
            async with grpc_worker(servicer) as address:
                await refused_decode(client, address, request, via)
            seen = servicer.requests
        else:
            async with channel_worker("decode", *REFUSED, seen=seen) as listener:
                client.token_channels.learn("w:1", listener)
                await token_channel_opens(client, "w:1")
                await refused_decode(client, "w:1", request, via)
    finally:
        await client.close()
    (decode,) = seen
    return decode


@pytest.mark.parametrize("via", [DecodeStream, ChannelDecodeStream])
async def test_a_decode_request_carries_the_requests_draft_hints(via):
    hints = (pb.DraftHint(token_ids=[5, 6, 7]).SerializeToString(), pb.DraftHint(token_ids=[8]).SerializeToString())
    seen = await decode_request_seen(GenerationRequest("r", [1, 2, 3], SamplingOptions(), 4, draft_hints=hints), via)
    assert [list(h.token_ids) for h in seen.draft_hints] == [[5, 6, 7], [8]] and not seen.no_drafts


@pytest.mark.parametrize("via", [DecodeStream, ChannelDecodeStream])
async def test_a_decode_request_with_drafting_off_says_so_and_without_hints_carries_none(via):
    seen = await decode_request_seen(GenerationRequest("r", [1, 2, 3], SamplingOptions(), 4, no_drafts=True), via)
    assert seen.no_drafts and len(seen.draft_hints) == 0
    plain = await decode_request_seen(GenerationRequest("r", [1, 2, 3], SamplingOptions(), 4), via)
    assert not plain.no_drafts and len(plain.draft_hints) == 0
