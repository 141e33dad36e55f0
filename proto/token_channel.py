"""Framing of the token channel (see TokenChannelFrame in worker.proto): a 4-byte big-endian length,
then a protobuf message. Shared by the decode worker's side and the coordinator's side."""

from __future__ import annotations

import enum
import struct

_LENGTH = struct.Struct(">I")
# A hello is a few hundred bytes; a step's frame is about 40 bytes per token (more with logprobs).
MAX_FRAME_BYTES = 64 << 20
MAX_HELLO_BYTES = 64 << 10
HELLO_TIMEOUT_S = 10.0


class ChannelState(enum.Enum):
    """A token channel's life, at either end: waiting for the other end's greeting, open, closed."""

    GREETING = "greeting"
    OPEN = "open"
    CLOSED = "closed"


class FrameError(Exception):
    """The peer broke the framing (a frame over the limit)."""


def encode_frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


class FrameReader:
    """Cuts a byte stream into frames; bytes of an unfinished frame wait for the next `feed`."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES):
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The frames `data` completes, in order; raises FrameError on a frame over the limit."""
        buffer = self._buffer
        buffer += data
        frames = []
        start, end = 0, len(buffer)
        while end - start >= 4:
            (length,) = _LENGTH.unpack_from(buffer, start)
            if length > self.max_frame_bytes:
                raise FrameError(f"token channel frame of {length} bytes is over the limit of {self.max_frame_bytes}")
            if end - start - 4 < length:
                break
            frames.append(bytes(buffer[start + 4:start + 4 + length]))
            start += 4 + length
        del buffer[:start]
        return frames
