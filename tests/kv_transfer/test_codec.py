"""KV serialisation: exact round trips per dtype; corruption and truncation are caught."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.base import KvTransferError, TransferredKv
from kv_transfer.codec import KvAssembler, encode_kv
from tests.helpers import bits, make_kv


def assemble(messages) -> TransferredKv:
    assembler = KvAssembler(messages[0].header)
    for m in messages[1:]:
        assembler.add_message(m)
    return assembler.finish()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [64, 1000, 4 * 1024 * 1024])
def test_kv_round_trip_is_bit_exact(dtype, chunk_bytes):
    kv = make_kv(dtype)
    messages = list(encode_kv(kv, chunk_bytes))
    out = assemble(messages)
    assert out.request_id == "req-1" and out.first_token_id == 42 and out.prefill_time_ms == 1.5
    for (k0, v0), (k1, v1) in zip(kv.layers, out.layers):
        assert k1.dtype == dtype and k1.shape == k0.shape
        assert torch.equal(bits(k0), bits(k1)) and torch.equal(bits(v0), bits(v1))


def test_flipped_byte_fails_the_checksum():
    messages = list(encode_kv(make_kv(torch.float32), 256))
    block = messages[5].block
    data = bytearray(block.data)
    data[3] ^= 0xFF
    block.data = bytes(data)
    with pytest.raises(KvTransferError, match="checksum mismatch"):
        assemble(messages)


def test_missing_block_is_detected_as_truncation():
    messages = list(encode_kv(make_kv(torch.float16), 256))
    with pytest.raises(KvTransferError, match="truncated"):
        assemble(messages[:-2] + messages[-1:])


def test_skipped_block_is_detected_by_offset():
    messages = list(encode_kv(make_kv(torch.float16), 256))
    del messages[2]
    with pytest.raises(KvTransferError, match="expected offset"):
        assemble(messages)


def test_block_beyond_the_tensor_is_rejected():
    messages = list(encode_kv(make_kv(torch.float32), 256))
    messages[1].block.offset = 10**9
    with pytest.raises(KvTransferError, match="overrun"):
        assemble(messages)


def test_header_whose_sizes_disagree_is_rejected():
    header = next(iter(encode_kv(make_kv(torch.float32)))).header
    header.tensor_bytes += 4
    with pytest.raises(KvTransferError, match="tensor_bytes"):
        KvAssembler(header)


def test_header_over_the_receive_limit_is_rejected():
    header = next(iter(encode_kv(make_kv(torch.float32)))).header
    with pytest.raises(KvTransferError, match="exceeds the receive limit"):
        KvAssembler(header, max_bytes=1024)


def test_stream_without_trailer_is_truncated():
    messages = list(encode_kv(make_kv(torch.float32), 256))
    with pytest.raises(KvTransferError, match="without its trailer"):
        assemble(messages[:-1])


def test_message_after_trailer_is_rejected():
    messages = list(encode_kv(make_kv(torch.float32), 256))
    with pytest.raises(KvTransferError, match="after its trailer"):
        assemble(messages + [messages[1]])
