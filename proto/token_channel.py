"""Framing of the token channel (see TokenChannelFrame in worker.proto): a 4-byte big-endian length,
then a protobuf message; or, with the length's top bit set, token records (below). Shared by the decode worker's
side and the coordinator's side."""

from __future__ import annotations

import enum
import struct

from proto.plain_token import PlainTokenEvent

_LENGTH = struct.Struct(">I")
# A frame of token records: the common token (mid-stream, no logprobs, no stop string) in a fixed binary layout,
# read without protobuf; sent only to a coordinator whose hello asked for them (TokenChannelHello.token_records).
TOKEN_RECORDS = 1 << 31
# Per record: request id length, text length, token id, index, batch size, time_ms, queue_wait_ms; then the request
# id and the text, UTF-8.
_RECORD = struct.Struct("<HHiiidd")
MAX_RECORD_FIELD_BYTES = 0xFFFF
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


def token_record(request_id: bytes, token_id: int, index: int, batch_size: int, time_ms: float, queue_wait_ms: float,
                 text: bytes) -> bytes:
    """One token's record (each of `request_id` and `text` at most MAX_RECORD_FIELD_BYTES)."""
    return _RECORD.pack(len(request_id), len(text), token_id, index, batch_size, time_ms, queue_wait_ms) + request_id + text


def encode_records(records: list[bytes]) -> bytes:
    payload = b"".join(records)
    return _LENGTH.pack(TOKEN_RECORDS | len(payload)) + payload


class TokenRecords(bytes):
    """A frame's payload of token records (FrameReader tells them from a protobuf frame by this type)."""


class RecordToken(PlainTokenEvent):
    """A token record as the pb.RoutedEvent with a pb.TokenEvent it stands for (`WhichOneof`, `token`): the record
    is both, so no second object is made per token."""

    __slots__ = ("request_id", "token_id", "index", "batch_size", "time_ms", "queue_wait_ms", "text")

    @property
    def token(self) -> RecordToken:
        return self

    def WhichOneof(self, _group: str) -> str:  # noqa: N802 - protobuf's name, so the channel reads both alike
        return "token"


def read_records(payload: bytes) -> list[RecordToken]:
    """The tokens of a TokenRecords payload; FrameError when it is cut or its text is not UTF-8."""
    tokens = []
    at, end, size, unpack = 0, len(payload), _RECORD.size, _RECORD.unpack_from
    try:
        while at < end:
            token = RecordToken()
            id_len, text_len, token.token_id, token.index, token.batch_size, token.time_ms, token.queue_wait_ms = \
                unpack(payload, at)
            at += size
            token.request_id = payload[at:at + id_len].decode()
            at += id_len
            token.text = payload[at:at + text_len].decode()
            at += text_len
            tokens.append(token)
    except (struct.error, UnicodeDecodeError) as exc:
        raise FrameError(f"a token record that cannot be read: {exc}") from None
    if at != end:
        raise FrameError("a token record cut short")
    return tokens


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
            kind = bytes
            if length & TOKEN_RECORDS:
                length, kind = length ^ TOKEN_RECORDS, TokenRecords
            if length > self.max_frame_bytes:
                raise FrameError(f"token channel frame of {length} bytes is over the limit of {self.max_frame_bytes}")
            if end - start - 4 < length:
                break
            frames.append(kind(buffer[start + 4:start + 4 + length]))
            start += 4 + length
        del buffer[:start]
        return frames
