"""A request's media items as the engine takes them: a prefill worker's item carries its file, or names the encode
worker holding its encoder output; anything else is refused naming the item."""

from __future__ import annotations

import pytest

from kv_events.block_hash import hash_to_bytes, media_content_hash
from proto import worker_pb2 as pb
from worker.engine.errors import InvalidRequest
from worker.engine.media import spans_from_pb

FILE = b"an image's file"
HASH = media_content_hash(FILE)


def item(data: bytes = b"", encoder: str = "", source: str = "messages.0.content.1", offset: int = 2,
         content_hash: int = HASH) -> pb.MediaItem:
    return pb.MediaItem(kind="image", data=data, content_hash=hash_to_bytes(content_hash), offset=offset,
                        num_tokens=4, source=source, encoder=encoder)


def test_an_item_naming_its_encode_worker_is_taken_without_its_file():
    (span,) = spans_from_pb([item(encoder="e0:7001")], prompt_len=10, with_data=True)
    assert (span.encoder, span.data, span.content_hash, span.offset, span.num_tokens) == ("e0:7001", b"", HASH, 2, 4)
    assert span.name == "messages.0.content.1"


def test_an_item_with_its_file_is_taken_with_no_encoder():
    (span,) = spans_from_pb([item(data=FILE)], prompt_len=10, with_data=True)
    assert (span.encoder, span.data, span.content_hash) == ("", FILE, HASH)


def test_items_pulled_and_items_encoded_here_mix_in_one_request():
    other = b"another image's file"
    spans = spans_from_pb([item(encoder="e0:7001", offset=0),
                           item(data=other, content_hash=media_content_hash(other), offset=5, source="x.1")],
                          prompt_len=10, with_data=True)
    assert [(s.encoder, s.data) for s in spans] == [("e0:7001", b""), ("", other)]


def test_an_item_with_neither_its_file_nor_an_encoder_is_refused_naming_it():
    with pytest.raises(InvalidRequest, match=r"^messages\.0\.content\.1: the image's data is missing$"):
        spans_from_pb([item()], prompt_len=10, with_data=True)
    with pytest.raises(InvalidRequest, match=r"^media\.1: the image's data is missing$"):
        spans_from_pb([item(data=FILE, offset=0, source=""), item(offset=5, source="")], prompt_len=10,
                      with_data=True)


def test_an_item_naming_an_encoder_is_still_checked_for_its_hash_and_span():
    with pytest.raises(InvalidRequest, match=r"^messages\.0\.content\.1: content_hash must be 16 bytes, got 3$"):
        spans_from_pb([pb.MediaItem(kind="image", content_hash=b"abc", offset=0, num_tokens=4,
                                    source="messages.0.content.1", encoder="e0:7001")], prompt_len=10, with_data=True)
    with pytest.raises(InvalidRequest, match=r"^messages\.0\.content\.1: placeholder span \[8, 12\)"):
        spans_from_pb([item(encoder="e0:7001", offset=8)], prompt_len=10, with_data=True)


def test_a_decode_worker_takes_an_item_naming_an_encoder_as_its_identity_only():
    (span,) = spans_from_pb([item(encoder="e0:7001")], prompt_len=10, with_data=False)
    assert (span.encoder, span.data, span.content_hash) == ("", b"", HASH)
