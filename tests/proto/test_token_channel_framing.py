"""The token channel's framing: frames cut from any split of the byte stream, oversized frames refused, token
records read back as the tokens they carry."""

from __future__ import annotations

import pytest

from proto.token_channel import (FrameError, FrameReader, TokenRecords, encode_frame, encode_records, read_records,
                                 token_record)


def test_frames_come_out_whole_however_the_bytes_are_split():
    payloads = [b"", b"a", b"hello" * 100, bytes(range(256))]
    stream = b"".join(encode_frame(p) for p in payloads)
    for step in (1, 3, 7, len(stream)):
        reader = FrameReader()
        out = []
        for start in range(0, len(stream), step):
            out += reader.feed(stream[start:start + step])
        assert out == payloads


def test_a_frame_over_the_limit_is_refused_before_it_is_buffered():
    reader = FrameReader(max_frame_bytes=10)
    assert reader.feed(encode_frame(b"x" * 10)) == [b"x" * 10]
    with pytest.raises(FrameError, match="11 bytes is over the limit of 10"):
        reader.feed(encode_frame(b"x" * 11)[:6])


def test_token_records_come_out_as_the_tokens_they_carry_between_protobuf_frames():
    records = [token_record(b"req-1", 42, 3, 16, 12.5, 0.25, "caf\u00e9".encode()),
               token_record("r\u00e9q-2".encode(), 7, 0, 1, 0.0, 0.0, b"")]
    stream = encode_frame(b"before") + encode_records(records) + encode_frame(b"after")
    for step in (1, 5, len(stream)):
        reader = FrameReader()
        frames = []
        for start in range(0, len(stream), step):
            frames += reader.feed(stream[start:start + step])
        assert [type(f) for f in frames] == [bytes, TokenRecords, bytes]
        assert frames[0] == b"before" and frames[2] == b"after"
        tokens = read_records(frames[1])
        assert [(t.request_id, t.token_id, t.index, t.batch_size, t.time_ms, t.queue_wait_ms, t.text)
                for t in tokens] == [("req-1", 42, 3, 16, 12.5, 0.25, "caf\u00e9"), ("r\u00e9q-2", 7, 0, 1, 0.0, 0.0, "")]
        # Each reads as the RoutedEvent with a mid-stream TokenEvent it stands for.
        assert tokens[0].WhichOneof("event") == "token" and tokens[0].token is tokens[0]
        assert tokens[0].finish_reason == 0 and tokens[0].matched_stop == "" and not tokens[0].top_logprobs


@pytest.mark.parametrize("payload, message", [
    (token_record(b"r", 1, 0, 1, 0.0, 0.0, b"abc")[:-1], "cut short"),
    (token_record(b"r", 1, 0, 1, 0.0, 0.0, b"abc")[:10], "cannot be read"),
    (token_record(b"r", 1, 0, 1, 0.0, 0.0, b"\xff"), "cannot be read"),
])
def test_a_damaged_token_record_is_a_frame_error(payload, message):
    with pytest.raises(FrameError, match=message):
        read_records(payload)


def test_a_records_frame_over_the_limit_is_refused():
    with pytest.raises(FrameError, match="over the limit of 10"):
        FrameReader(max_frame_bytes=10).feed(encode_records([b"x" * 11]))
