"""Tokens written straight from their token channel frame (TokenSink.direct, serving.TokenWriter): in order, only
while nothing is queued before them and the client keeps up; a stalled client's tokens wait in the request's task."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from coordinator.requests.request import TokenDelta
from coordinator.requests.serving import SseFormatter, TokenWriter, Transcript
from coordinator.workers.token_channels import TokenChannel, TokenSink
from proto import worker_pb2 as pb
from proto.token_channel import ChannelState, encode_frame
from worker.simulated.tokens import synthetic_token, token_key, token_text
from tests.helpers import sse_events, start_coordinator, start_sim_worker, write_config


def token_event(index: int) -> pb.RoutedEvent:
    return pb.RoutedEvent(request_id="r", token=pb.TokenEvent(token_id=index, text=f"t{index}", index=index))


async def test_sink_hands_events_to_direct_while_nothing_is_queued_and_queues_from_the_first_it_refuses():
    sink, taken = TokenSink(), []
    accept = True

    def direct(event):
        if accept:
            taken.append(event.token.index)
        return accept

    sink.direct = direct
    sink.push(token_event(0))
    sink.push(token_event(1))
    accept = False
    sink.push(token_event(2))
    accept = True
    sink.push(token_event(3))  # behind a queued event: queued too, or it would overtake it
    assert taken == [0, 1]
    assert [(await sink.next()).token.index for _ in range(2)] == [2, 3]
    sink.push(token_event(4))  # the queue drained: direct again
    assert taken == [0, 1, 4]


async def test_an_error_in_direct_fails_the_reading_task_with_it_before_any_later_event():
    sink = TokenSink()

    def direct(event):
        raise ValueError("formatter broke")

    sink.direct = direct
    sink.push(token_event(0))  # the channel's callback is not where it surfaces
    sink.push(token_event(1))  # after the failed one: never read, or the client would get it without token 0
    with pytest.raises(ValueError, match="formatter broke"):
        await sink.next()
    with pytest.raises(ValueError, match="formatter broke"):
        await sink.next()


async def test_an_error_in_flush_fails_the_reading_task_and_nothing_more_is_taken_directly():
    sink, taken = TokenSink(), []

    def flush():
        raise ConnectionResetError("client gone")

    sink.direct = lambda event: taken.append(event.token.index) is None
    sink.flush = flush
    assert sink.push(token_event(0)) is True  # the first taken since a flush: the channel owes it one
    assert sink.push(token_event(1)) is False  # owed already
    sink.flush_direct()
    sink.push(token_event(2))
    assert taken == [0, 1]
    with pytest.raises(ConnectionResetError, match="client gone"):
        await sink.next()


class BufferingTransport:
    """Stands in for a client connection's transport: what was written, and how much is still unsent."""

    def __init__(self, unsent: int = 0):
        self.unsent = unsent
        self.closing = False
        self.written: list[bytes] = []

    def get_write_buffer_size(self) -> int:
        return self.unsent

    def is_closing(self) -> bool:
        return self.closing

    def write(self, data: bytes) -> None:
        self.written.append(data)


class OpenStream:
    def __init__(self, transport, chunked: bool = True):
        self.transport = transport
        self.chunked = chunked


def test_writer_takes_a_mid_stream_token_only_on_an_open_chunked_stream_not_busy_whose_client_keeps_up():
    transport = BufferingTransport()
    writer = TokenWriter(TextFormatter(), Transcript())
    made = []

    def to_delta(token):
        made.append(token.index)
        return TokenDelta(token.token_id, token.text, token.index, 1.0)

    def takes(token=pb.TokenEvent(token_id=1, text="a", index=1)) -> bool:
        return writer.take(token, to_delta)

    assert not takes()  # not open yet
    writer.open(OpenStream(transport, chunked=False), OpenStream(None, chunked=False))
    assert not takes()  # HTTP/1.0: aiohttp frames it
    writer.open(OpenStream(transport), OpenStream(None))
    writer.busy = True
    assert not takes()
    writer.busy = False
    transport.unsent = TokenWriter.HIGH_WATER + 1
    assert not takes()  # the client is behind: the task waits for it
    transport.unsent, transport.closing = 0, True
    assert not takes()
    transport.closing = False
    assert not takes(pb.TokenEvent(token_id=2, text="b", index=2, finish_reason=pb.FINISH_REASON_LENGTH))  # the last
    assert made == [] and writer.transcript.token_ids == []  # nothing refused was recorded
    assert takes()
    assert made == [1] and writer.transcript.token_ids == [1]
    writer.flush()
    assert transport.written == [b'14\r\ndata: {"text":"a"}\n\n\r\n']


class TextFormatter(SseFormatter):
    def token_frames(self, delta, transcript):
        return [{"text": delta.text}]


def test_writer_records_the_token_and_frames_it_as_one_http_chunk_sent_at_the_flush():
    transport, transcript = BufferingTransport(), Transcript()
    writer = TokenWriter(TextFormatter(), transcript)
    writer.open(OpenStream(transport), OpenStream(None))
    writer.write(TokenDelta(token_id=7, text="hé", index=0, time_ms=1.0))
    assert transport.written == [] and transcript.text == "hé" and transcript.token_ids == [7]
    writer.flush()
    body = 'data: {"text":"hé"}\n\n'.encode()
    assert transport.written == [b"%x\r\n" % len(body) + body + b"\r\n"]
    writer.flush()  # nothing new: nothing written
    assert len(transport.written) == 1


def chunk(text: str) -> bytes:
    body = f'data: {{"text":"{text}"}}\n\n'.encode()
    return b"%x\r\n" % len(body) + body + b"\r\n"


async def test_tokens_of_one_request_in_one_channel_read_leave_in_one_write_in_order():
    channel = TokenChannel("w:1", "w:2")
    channel.state = ChannelState.OPEN
    transports = {rid: BufferingTransport() for rid in ("a", "b")}
    for rid, transport in transports.items():
        writer = TokenWriter(TextFormatter(), Transcript())
        writer.open(OpenStream(transport), OpenStream(None))
        sink = channel.sinks[rid] = TokenSink()
        sink.direct = lambda event, w=writer: w.write(TokenDelta(event.token.token_id, event.token.text,
                                                                  event.token.index, 1.0)) is None
        sink.flush = writer.flush

    def frame(*events) -> bytes:
        return encode_frame(pb.TokenChannelFrame(events=list(events)).SerializeToString())

    def token(rid: str, index: int) -> pb.RoutedEvent:
        return pb.RoutedEvent(request_id=rid, token=pb.TokenEvent(token_id=index, text=f"{rid}{index}", index=index))

    # Three steps' frames in one read (a busy coordinator reads what queued up): one write per request.
    data = frame(token("a", 0), token("b", 0)) + frame(token("a", 1), token("b", 1)) + frame(token("a", 2))
    channel.data_received(data[:7])  # a frame cut across reads: nothing complete, nothing written
    assert transports["a"].written == transports["b"].written == []
    channel.data_received(data[7:])
    assert transports["a"].written == [chunk("a0") + chunk("a1") + chunk("a2")]
    assert transports["b"].written == [chunk("b0") + chunk("b1")]
    channel.data_received(frame(token("b", 2)))  # the next read: its own write, not held for more
    assert transports["b"].written == [chunk("b0") + chunk("b1"), chunk("b2")]
    # A frame that does not parse after a good one in the same read: the good one's token still leaves.
    with pytest.raises(Exception):
        channel.data_received(frame(token("a", 3)) + encode_frame(b"\xff\xff\xff"))
    assert transports["a"].written[-1] == chunk("a3")


async def test_tokens_taken_before_a_failing_one_in_the_same_read_are_sent_before_the_failure_surfaces():
    sink, transport = TokenSink(), BufferingTransport()
    writer = TokenWriter(TextFormatter(), Transcript())
    writer.open(OpenStream(transport), OpenStream(None))

    def direct(event):
        if event.token.index == 1:
            raise ValueError("formatter broke")
        writer.write(TokenDelta(event.token.token_id, event.token.text, event.token.index, 1.0))
        return True

    sink.direct, sink.flush = direct, writer.flush
    assert sink.push(token_event(0)) is True
    sink.push(token_event(1))
    assert transport.written == [chunk("t0")]
    with pytest.raises(ValueError, match="formatter broke"):
        await sink.next()


TOKENS = 15000
SIMULATED_VOCAB = 32000
# Chunks of about 2 KiB (20 alternatives each): more than the kernel's socket buffers hold, so the coordinator's own
# buffer fills while a client is stalled.
REQUEST = {"model": "pdserve-tiny", "messages": [{"role": "user", "content": "hello"}], "ignore_eos": True, "seed": 11,
           "logprobs": True, "top_logprobs": 20}


def expected_text(tokens: int) -> str:
    """Simulated tokens follow from the seed and their index: the text says every one came, in order."""
    return "".join(token_text(synthetic_token(token_key("", 11), i, SIMULATED_VOCAB)) for i in range(tokens))


@pytest.fixture(scope="module")
def sim_coordinator(model_dir, tmp_path_factory):
    """A coordinator in front of simulated workers, its token channel to the decode worker open."""
    prefill = start_sim_worker("prefill", "--sim-vocab-size", str(SIMULATED_VOCAB))
    decode = start_sim_worker("decode", "--sim-decode-base-ms", "0.2", "--sim-vocab-size", str(SIMULATED_VOCAB))
    coordinator = None
    try:
        config = write_config(tmp_path_factory.mktemp("direct") / "ms_coordinator.json", [prefill.address],
                              [decode.address], model_dir, maxSeqLen=16384, maxIterTimes=16000)
        coordinator = start_coordinator(config)
        with httpx.Client(base_url=coordinator.address, timeout=60) as http:  # the token channel opens
            assert http.post("/v1/chat/completions", json={**REQUEST, "max_tokens": 2}).status_code == 200
        yield urlsplit(coordinator.address)
    finally:
        for process in (coordinator, decode, prefill):
            if process is not None:
                process.stop()


def raw_stream(url, version: bytes, tokens: int, stall_s: float = 0.0) -> tuple[bytes, bytes]:
    """A streamed chat request over a raw socket with request line `version`, read to the end after `stall_s`
    without reading: the response head and body."""
    body = json.dumps({**REQUEST, "max_tokens": tokens, "stream": True}).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((url.hostname, url.port))
        sock.sendall(b"POST /v1/chat/completions %b\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n%b" % (version, len(body), body))
        raw = [sock.recv(4096)]
        time.sleep(stall_s)
        while chunk := sock.recv(65536):
            raw.append(chunk)
    head, _, rest = b"".join(raw).partition(b"\r\n\r\n")
    return head, rest


def unchunked(chunked: bytes) -> bytes:
    stream = bytearray()
    while True:
        size_line, _, chunked = chunked.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return bytes(stream)
        stream += chunked[:size]
        chunked = chunked[size + 2:]


def streamed_text(stream: bytes, tokens: int) -> str:
    payloads = sse_events(stream)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert len(chunks) == tokens + 1  # and the final chunk
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)


@pytest.mark.system
def test_a_client_that_stops_reading_mid_stream_gets_every_token_in_order(sim_coordinator):
    head, body = raw_stream(sim_coordinator, b"HTTP/1.1", TOKENS, stall_s=3.0)
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    assert streamed_text(unchunked(body), TOKENS) == expected_text(TOKENS)


@pytest.mark.system
@pytest.mark.parametrize("version", [b"HTTP/1.0", b"HTTP/2.0"])
def test_a_stream_aiohttp_frames_itself_is_complete_and_in_order(sim_coordinator, version):
    head, body = raw_stream(sim_coordinator, version, 300)
    assert b" 200 " in head.split(b"\r\n")[0]
    chunked = b"transfer-encoding: chunked" in head.lower()
    assert chunked == (version != b"HTTP/1.0")
    assert streamed_text(unchunked(body) if chunked else body, 300) == expected_text(300)
