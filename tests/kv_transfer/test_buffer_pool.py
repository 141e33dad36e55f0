"""Receive buffers are reused, within the pool's limit."""

from __future__ import annotations

import torch

from kv_transfer.buffer_pool import KvBufferPool
from kv_transfer.codec import KvAssembler, encode_kv
from tests.helpers import make_kv


def test_given_back_buffer_is_handed_out_again():
    pool = KvBufferPool()
    a = pool.take(3 << 20)
    assert a.numel() == 3 << 20
    pool.give(a)
    b = pool.take(3 << 20)
    assert b.data_ptr() == a.data_ptr() and pool.pooled_bytes == 0


def test_pool_keeps_no_more_than_its_limit():
    pool = KvBufferPool(max_pooled_bytes=2 << 20)
    bufs = [pool.take(1 << 20) for _ in range(3)]
    for b in bufs:
        pool.give(b)
    assert pool.pooled_bytes == 2 << 20


def test_released_kv_returns_its_buffer_and_reuse_stays_exact():
    pool = KvBufferPool()
    for dtype in (torch.float32, torch.bfloat16):
        kv = make_kv(dtype)
        messages = list(encode_kv(kv, 1024))
        assembler = KvAssembler(messages[0].header, pool=pool)
        for m in messages[1:]:
            assembler.add_message(m)
        out = assembler.finish()
        for (k0, _), (k1, _) in zip(kv.layers, out.layers):
            assert torch.equal(k0.view(torch.uint8), k1.contiguous().view(torch.uint8))
        out.release()
        assert pool.pooled_bytes > 0
