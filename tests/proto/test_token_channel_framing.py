"""The token channel's framing: frames cut from any split of the byte stream, oversized frames refused."""

from __future__ import annotations

import pytest

from proto.token_channel import FrameError, FrameReader, encode_frame


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
