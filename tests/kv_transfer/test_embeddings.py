"""An image's encoder output between workers: its bytes arrive exactly, and every stream that is not the tensor
asked for is refused before its bytes are used, naming the item and what did not fit."""

from __future__ import annotations

import re

import pytest
import torch

from kv_transfer.embeddings import (MAX_EMBEDDING_BYTES, EmbeddingsReceiver, EmbeddingsRefused, EmbeddingsShape,
                                    embeddings_messages)
from kv_transfer.wire import checksum
from proto import worker_pb2 as pb

IMAGE = b"\x11" * 16
OTHER_IMAGE = b"\x22" * 16
WHERE = "messages.0.content.1"
ROWS, HIDDEN = 5, 7


def features(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(ROWS * HIDDEN, dtype=torch.float32).view(ROWS, HIDDEN).mul(0.37).sub(3).to(dtype)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def stream(dtype_name: str = "float32", tensor: torch.Tensor | None = None, content_hash: bytes = IMAGE,
           rows: int = ROWS, hidden: int = HIDDEN, chunk_bytes: int = 33) -> list[pb.EmbeddingsMessage]:
    """The messages of one tensor, as they arrive (each through the wire's encoding)."""
    data = tensor_bytes(features() if tensor is None else tensor)
    return [pb.EmbeddingsMessage.FromString(m.SerializeToString())
            for m in embeddings_messages(content_hash, rows, hidden, dtype_name, data, chunk_bytes=chunk_bytes)]


def receiver(rows: int = ROWS, hidden: int = HIDDEN, dtype: str = "float32") -> EmbeddingsReceiver:
    return EmbeddingsReceiver(IMAGE, EmbeddingsShape(rows, hidden, dtype), WHERE)


def receive(messages, into: EmbeddingsReceiver | None = None) -> bytearray:
    into = into or receiver()
    for message in messages:
        into.take(message)
    return into.finish()


def refused(why: str):
    """EmbeddingsRefused naming the item, then `why` (a regular expression)."""
    return pytest.raises(EmbeddingsRefused, match=rf"^{re.escape(WHERE)}: embeddings refused: .*{why}")


@pytest.mark.parametrize(("dtype", "name"), [(torch.float32, "float32"), (torch.float16, "float16"),
                                             (torch.bfloat16, "bfloat16")])
@pytest.mark.parametrize("chunk_bytes", [1, 33, 4096])
def test_a_tensor_arrives_bit_exact_whatever_the_chunking(dtype, name, chunk_bytes):
    sent = features(dtype)
    messages = stream(name, sent, chunk_bytes=chunk_bytes)
    assert len(messages) == 1 + -(-sent.numel() * sent.element_size() // chunk_bytes)
    got = receive(messages, receiver(dtype=name))
    back = torch.frombuffer(got, dtype=dtype).view(ROWS, HIDDEN)
    assert torch.equal(back.view(torch.uint8), sent.view(torch.uint8))


def test_chunks_split_elements_and_each_carries_its_own_checksum():
    messages = stream(chunk_bytes=33)  # 140 bytes of float32: chunks of 33 cut elements in two
    header, chunks = messages[0].header, [m.chunk for m in messages[1:]]
    assert (header.content_hash, header.rows, header.hidden, header.dtype, header.num_bytes) == \
        (IMAGE, ROWS, HIDDEN, "float32", ROWS * HIDDEN * 4)
    assert [len(c.data) for c in chunks] == [33, 33, 33, 33, 8]
    assert all(c.checksum == checksum(c.data) for c in chunks)
    assert b"".join(c.data for c in chunks) == tensor_bytes(features())


def test_a_stream_that_does_not_start_with_its_header_is_refused():
    messages = stream()
    with refused("did not start with its header"):
        receive(messages[1:])


def test_a_second_header_is_refused():
    messages = stream()
    with refused("a second header came"):
        receive([messages[0], messages[1], messages[0]])


def test_a_header_naming_another_image_is_refused():
    with refused("the header names another image"):
        receive(stream(content_hash=OTHER_IMAGE))


def test_a_shape_the_model_does_not_take_is_refused_saying_what_it_takes():
    with refused(r"shape \[5, 7\] of float32 does not fit this model, which takes \[5, 8\] of float32"):
        receive(stream(), receiver(hidden=8))
    with refused(r"shape \[5, 7\] of float32 does not fit this model, which takes \[6, 7\] of float32"):
        receive(stream(), receiver(rows=6))


def test_another_dtype_than_the_models_is_refused():
    with refused(r"shape \[5, 7\] of float16 does not fit this model, which takes \[5, 7\] of float32"):
        receive(stream("float16", features(torch.float16)))


def test_an_unknown_dtype_is_refused_naming_the_known_ones():
    messages = stream()
    messages[0].header.dtype = "float8"
    with refused(r"dtype 'float8' is not one of \['bfloat16', 'float16', 'float32'\]"):
        receive(messages)


@pytest.mark.parametrize("num_bytes", [ROWS * HIDDEN * 4 - 1, ROWS * HIDDEN * 4 + 4, 0])
def test_a_byte_count_that_does_not_match_the_shape_is_refused(num_bytes):
    messages = stream()
    messages[0].header.num_bytes = num_bytes
    with refused(rf"{num_bytes} bytes announced for \[5, 7\] of float32 \(140 expected"):
        receive(messages)


def test_an_output_over_the_size_bound_is_refused_at_its_header():
    rows, hidden = 4097, 8192  # float32: just over MAX_EMBEDDING_BYTES
    assert rows * hidden * 4 > MAX_EMBEDDING_BYTES
    header = pb.EmbeddingsMessage(header=pb.EmbeddingsHeader(content_hash=IMAGE, rows=rows, hidden=hidden,
                                                             dtype="float32", num_bytes=rows * hidden * 4))
    with refused(rf"at most {MAX_EMBEDDING_BYTES}"):
        receiver(rows, hidden).take(header)


def test_a_chunk_with_a_flipped_byte_fails_its_checksum():
    messages = stream(chunk_bytes=33)
    chunk = messages[3].chunk
    data = bytearray(chunk.data)
    data[5] ^= 0x01
    chunk.data = bytes(data)
    with refused(r"a chunk's checksum does not match its bytes \(at byte 66\)"):
        receive(messages)


def test_more_bytes_than_announced_are_refused():
    extra = b"\x00" * 4
    messages = stream() + [pb.EmbeddingsMessage(chunk=pb.EmbeddingsChunk(data=extra, checksum=checksum(extra)))]
    with refused("more than the header's 140 bytes came"):
        receive(messages)


def test_a_stream_that_ends_short_is_refused():
    messages = stream(chunk_bytes=33)
    with refused("the stream ended after 132 of 140 bytes"):
        receive(messages[:-1])
    with refused("the stream ended after 0 of 140 bytes"):
        receive(messages[:1])


def test_an_empty_stream_is_refused():
    with refused("the stream ended before its header"):
        receive([])
