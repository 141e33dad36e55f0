"""KV serialisation: exact round trips per dtype, into a buffer or scattered pool blocks; corruption, truncation and
another layout version are caught."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.base import KvTransferError, TransferredKv
from kv_transfer.codec import KvAssembler, encode_kv, tensor_bytes
from tests.helpers import bits, landed_bytes, make_kv, scattered_landing


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


@pytest.mark.parametrize("version, named", [
    (0, "0 (not set: a worker from before layout versions, head-major)"), (1, "1 (head-major)"), (3, "3")])
def test_a_header_of_another_layout_version_is_refused_naming_both_versions(version, named):
    header = next(iter(encode_kv(make_kv(torch.float32)))).header
    header.kv_layout_version = version
    with pytest.raises(KvTransferError) as refused:
        KvAssembler(header, landing_for=lambda h: pytest.fail("no blocks may be taken for a refused stream"))
    assert str(refused.value) == (f"KV layout version {named} from the prefill worker; this worker reads version 2 "
                                  "(token-major per block)")


def test_the_wire_layout_is_token_major():
    kv = make_kv(torch.float16, layers=1, seq=5)
    messages = list(encode_kv(kv, 1 << 20))
    assert list(messages[0].header.shape) == [5, 2, 16] and messages[0].header.kv_layout_version == 2
    key = kv.layers[0][0]
    assert messages[1].block.data[: 2 * 16 * 2] == bytes(tensor_bytes(key[0]))  # position 0's heads come first


@pytest.mark.parametrize("chunk_bytes", [64, 1000, 4 * 1024 * 1024])
def test_a_cache_received_into_scattered_pool_blocks_lands_in_them_exact(chunk_bytes):
    kv = make_kv(torch.float16)
    messages = list(encode_kv(kv, chunk_bytes))
    landing, given_back = scattered_landing(messages[0].header)
    assembler = KvAssembler(messages[0].header, landing_for=lambda header: landing)
    for m in messages[1:]:
        assembler.add_message(m)
    out = assembler.finish()
    assert out.landed is landing and out.layers == [] and out.seq_len == 37 and out.first_token_id == 42
    for i, (k, v) in enumerate(kv.layers):
        assert landed_bytes(landing, 2 * i) == bytes(tensor_bytes(k))
        assert landed_bytes(landing, 2 * i + 1) == bytes(tensor_bytes(v))
    out.release()
    out.release()
    assert given_back == [landing.block_ids]  # once


def test_pool_blocks_the_engine_took_are_not_given_back():
    messages = list(encode_kv(make_kv(torch.float32), 256))
    landing, given_back = scattered_landing(messages[0].header)
    assembler = KvAssembler(messages[0].header, landing_for=lambda header: landing)
    for m in messages[1:]:
        assembler.add_message(m)
    out = assembler.finish()
    assert out.landed.take() == landing.block_ids
    out.release()
    assert given_back == []


def test_a_corrupt_stream_into_pool_blocks_gives_them_back_when_discarded():
    messages = list(encode_kv(make_kv(torch.float32), 256))
    messages[4].block.data = b"\x00" + messages[4].block.data[1:]
    landing, given_back = scattered_landing(messages[0].header)
    assembler = KvAssembler(messages[0].header, landing_for=lambda header: landing)
    with pytest.raises(KvTransferError, match="checksum mismatch"):
        for m in messages[1:]:
            assembler.add_message(m)
    assembler.discard()
    assert given_back == [landing.block_ids]
