"""Token records on a decode worker's token channel: only the common token becomes one, only for a coordinator that
asks, and a turn's events keep their order across records frames and protobuf frames; and a request's sampling
checked before its engine sees it."""

from __future__ import annotations

import asyncio

import pytest

from proto import worker_pb2 as pb
from proto.token_channel import (ChannelState, FrameReader, TokenRecords, encode_frame, encode_records, read_records,
                                 token_record)
from worker.engine.sequence import StopCause, TokenLogprobs, TokenOutput
from worker.engine.errors import InvalidRequest
from worker.service.request_checks import MAX_TOP_LOGPROBS, checked_sampling
from worker.service.token_events import relayed
from worker.service.token_channel import CoordinatorConnection, TokenChannelListener


def output(**changes) -> TokenOutput:
    token = TokenOutput(5, "hi", 1.5, 3, batch_size=4, queue_wait_ms=0.5)
    for name, value in changes.items():
        setattr(token, name, value)
    return token


def test_the_common_token_goes_as_a_record_where_the_coordinator_reads_them():
    [token] = read_records(relayed("req", output(), as_record=True))
    assert (token.request_id, token.token_id, token.text, token.time_ms, token.index, token.batch_size,
            token.queue_wait_ms) == ("req", 5, "hi", 1.5, 3, 4, 0.5)
    assert isinstance(relayed("req", output()), pb.RoutedEvent)


@pytest.mark.parametrize("changes", [{"finish_reason": StopCause.LENGTH}, {"matched_stop": "x"},
                                     {"logprobs": TokenLogprobs(-0.5)}, {"text": "x" * 70_000}])
def test_a_last_token_logprobs_a_stop_or_an_oversized_text_go_as_a_protobuf_event(changes):
    event = relayed("req", output(**changes), as_record=True)
    assert isinstance(event, pb.RoutedEvent) and event.token.token_id == 5


class _Transport:
    """The socket's side: what the connection writes."""

    def __init__(self):
        self.written = bytearray()
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True

    def write(self, data: bytes) -> None:
        self.written += data

    def get_write_buffer_size(self) -> int:
        return 0


async def test_a_turns_records_and_protobuf_events_leave_in_the_order_they_were_sent():
    connection = CoordinatorConnection(TokenChannelListener(serve=None, health=None))
    connection._transport = transport = _Transport()
    connection.state, connection.token_records = ChannelState.OPEN, True
    connection.send(relayed("a", output(index=1), as_record=True))
    connection.send(relayed("b", output(index=1), as_record=True))
    connection.send(relayed("a", output(index=2, finish_reason=StopCause.EOS), as_record=True))
    connection.send(relayed("b", output(index=2), as_record=True))
    await asyncio.sleep(0)  # the turn's single write
    order = []
    for frame in FrameReader().feed(bytes(transport.written)):
        if isinstance(frame, TokenRecords):
            order += [(t.request_id, t.index, "record") for t in read_records(frame)]
        else:
            order += [(e.request_id, e.token.index, "event") for e in pb.TokenChannelFrame.FromString(frame).events]
    assert order == [("a", 1, "record"), ("b", 1, "record"), ("a", 2, "event"), ("b", 2, "record")]


@pytest.mark.parametrize("asks", [False, True])
async def test_records_are_sent_only_to_a_coordinator_whose_hello_asks_for_them(asks):
    connection = CoordinatorConnection(TokenChannelListener(serve=None, health=None))
    connection.connection_made(_Transport())
    connection.data_received(encode_frame(pb.TokenChannelHello(token_records=asks).SerializeToString()))
    assert connection.state is ChannelState.OPEN and connection.token_records is asks


async def test_a_records_frame_from_a_coordinator_breaks_the_channel():
    connection = CoordinatorConnection(TokenChannelListener(serve=None, health=None))
    connection.connection_made(transport := _Transport())
    connection.data_received(encode_records([token_record(b"r", 1, 0, 1, 0.0, 0.0, b"x")]))
    assert transport.aborted and connection.state is ChannelState.GREETING


@pytest.mark.parametrize("field", ["top_logprobs", "prompt_top_logprobs"])
async def test_a_logprobs_count_past_the_limit_is_an_invalid_request_before_the_engine_sees_it(field):
    msg = pb.SamplingParams(return_logprobs=True, return_prompt_logprobs=True, **{field: MAX_TOP_LOGPROBS + 1})
    with pytest.raises(InvalidRequest, match=f"{field}=21 must be in"):
        await checked_sampling(None, msg)
