"""A decode worker receives a KV cache straight into its block pool: the bytes are in the sequence's blocks before it
joins, joining copies nothing, and every block taken for a transfer comes back whichever way it ends."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from kv_transfer.base import KvTransferError
from kv_transfer.codec import encode_kv
from kv_transfer.sink import KvSink
from kv_transfer.transfer_tokens import KvTransferTokens
from worker.engine.block_pool import BlockTable
from worker.engine.sequence import DecodeState, SamplingParams
from worker.metrics import WorkerMetrics
from worker.torch_engine import decode_engine
from worker.torch_engine.build import paged_pool
from worker.torch_engine.decode_engine import DecodeEngine
from worker.torch_engine.kv_cache import KvCache
from worker.torch_engine.model_runner import ModelRunner
from tests.helpers import hf_prefill, reference_tokens

PROMPT = ("Once upon a time there was a little server that served tokens. It served them one block at a time, "
          "straight into the pool.")
BLOCK_SIZE = 8  # 41 prompt positions: 5 full blocks and one part filled
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    return ModelRunner(model_dir)


@pytest.fixture
def ids(hf_model) -> list[int]:
    return hf_model[1](PROMPT)["input_ids"]


class Decoding:
    """A DecodeEngine with its metrics, a KV sink as the worker wires one, KvCache.write's calls, and each joining
    sequence's blocks."""

    def __init__(self, runner: ModelRunner, monkeypatch, tokens: int = 256):
        self.pool = paged_pool(runner, tokens, BLOCK_SIZE)
        self.engine = DecodeEngine(runner, self.pool)
        self.metrics = self.engine.metrics = WorkerMetrics("decode", self.engine)
        self.tokens = KvTransferTokens()
        self.sink = KvSink(self.engine.on_kv, self.engine.fail, self.tokens, pool=self.engine.kv_pool,
                           assembler=self.engine.kv_assembler)
        self.writes = []
        write = KvCache.write
        monkeypatch.setattr(KvCache, "write", lambda cache, *args: self.writes.append(args) or write(cache, *args))
        self.free_at_start = self.pool.stats().free_blocks
        self.joined = []
        place = self.engine._place_received
        self.engine._place_received = lambda seq: self.joined.append(list(seq.table.block_ids)) or place(seq)

    async def accept(self, hf_model, rid: str, ids: list[int]):
        """Register and admit a request, and the messages of its KV stream (HF's cache, carrying its token)."""
        handle = self.engine.register(rid, len(ids), SamplingParams(max_tokens=MAX_TOKENS), 512, ids)
        await self.engine.admit(handle)
        kv = hf_prefill(hf_model, rid, ids)
        kv.transfer_token = self.tokens.issue(rid)
        return handle, kv, list(encode_kv(kv, chunk_bytes=300))

    async def open(self, messages):
        """Open the stream as a receiver does, on its own thread (taking blocks waits for the engine thread)."""
        return await asyncio.to_thread(self.sink.open, messages[0].header, "tcp")

    def fallbacks(self, reason: str) -> float:
        return self.metrics.registry.get_sample_value("pdserve_worker_kv_receive_fallbacks_total",
                                                      {"reason": reason}) or 0.0

    async def blocks_back(self, timeout_s: float = 5.0) -> None:
        """Wait until every block is free or cached again (blocks go back through the engine thread)."""
        deadline = time.monotonic() + timeout_s
        while self.pool.stats().free_blocks != self.free_at_start:
            assert time.monotonic() < deadline, f"blocks not given back: {self.pool.stats()}"
            await asyncio.sleep(0.01)


@pytest.fixture
async def decoding(runner, monkeypatch):
    d = Decoding(runner, monkeypatch)
    d.engine.start()
    yield d
    d.engine.shutdown()


async def read_all(handle) -> list:
    outputs = []
    while not outputs or outputs[-1].finish_reason is None:
        item = await asyncio.wait_for(handle.events.get(), 30)
        assert not isinstance(item, Exception), item
        outputs.append(item)
    return outputs


def slots_of(block_ids: list[int], n: int) -> torch.Tensor:
    return torch.tensor([b * BLOCK_SIZE + i for b in block_ids for i in range(BLOCK_SIZE)][:n])


async def test_a_received_cache_is_in_its_blocks_before_the_sequence_joins_and_joining_copies_nothing(
        decoding, runner, hf_model, ids):
    handle, kv, messages = await decoding.accept(hf_model, "r1", ids)
    verifier = await decoding.open(messages)
    landing = verifier.landing
    assert landing is not None and len(landing.block_ids) == decoding.pool.blocks_for(len(ids))
    for m in messages[1:]:
        verifier.add_message(m)
    # Every layer's bytes are in the pool's slots while the request still waits for its cache.
    assert handle.state is DecodeState.WAITING_FOR_KV
    slots = slots_of(landing.block_ids, len(ids))
    for i, (k, v) in enumerate(kv.layers):
        assert torch.equal(runner.cache.keys[i][slots], k) and torch.equal(runner.cache.values[i][slots], v)
    decoding.sink.deliver(verifier)
    outputs = await read_all(handle)
    assert [o.token_id for o in outputs] == reference_tokens(hf_model, ids, MAX_TOKENS)
    assert decoding.writes == []  # joining copied nothing
    assert decoding.joined == [landing.block_ids]
    assert sum(decoding.fallbacks(r) for r in ("no_room", "device", "engine_busy")) == 0
    decoding.engine.release("r1")
    await decoding.blocks_back()


async def test_without_room_in_the_pool_the_cache_is_copied_at_join_with_the_same_tokens(
        decoding, hf_model, ids):
    handle, kv, messages = await decoding.accept(hf_model, "r1", ids)
    hog = BlockTable()  # the pool's free blocks, held elsewhere when the header comes
    assert decoding.pool.grow(hog, decoding.pool.num_free * BLOCK_SIZE)
    verifier = await decoding.open(messages)
    decoding.pool.release(hog)
    assert verifier.landing is None and decoding.fallbacks("no_room") == 1
    for m in messages[1:]:
        verifier.add_message(m)
    decoding.sink.deliver(verifier)
    outputs = await read_all(handle)
    assert [o.token_id for o in outputs] == reference_tokens(hf_model, ids, MAX_TOKENS)
    assert len(decoding.writes) == 1  # the receive buffer, copied into its blocks when it joined
    decoding.engine.release("r1")
    await decoding.blocks_back()


async def test_blocks_taken_for_a_corrupt_transfer_go_back_and_its_request_fails(decoding, hf_model, ids):
    handle, kv, messages = await decoding.accept(hf_model, "r1", ids)
    verifier = await decoding.open(messages)
    assert decoding.pool.stats().free_blocks == decoding.free_at_start - len(verifier.landing.block_ids)
    messages[3].block.data = b"\x01" + messages[3].block.data[1:]
    with pytest.raises(KvTransferError, match="checksum mismatch") as failed:
        for m in messages[1:]:
            verifier.add_message(m)
    decoding.sink.reject("r1", verifier, str(failed.value))
    assert isinstance(await asyncio.wait_for(handle.events.get(), 5), KvTransferError)
    decoding.engine.release("r1")
    await decoding.blocks_back()


async def test_blocks_taken_for_the_cache_of_an_aborted_request_go_back(decoding, hf_model, ids):
    handle, kv, messages = await decoding.accept(hf_model, "r1", ids)
    verifier = await decoding.open(messages)
    decoding.engine.release("r1")  # the client went away while its cache was on the wire
    for m in messages[1:]:
        verifier.add_message(m)
    with pytest.raises(KvTransferError, match="no decode request 'r1' is waiting") as refused:
        decoding.sink.deliver(verifier)
    decoding.sink.reject("r1", verifier, str(refused.value))
    await decoding.blocks_back()


async def test_blocks_answered_after_the_receiver_gave_up_waiting_go_back(runner, monkeypatch, hf_model, ids):
    d = Decoding(runner, monkeypatch)
    monkeypatch.setattr(decode_engine, "BLOCKS_WAIT_S", 0.05)
    handle, kv, messages = await d.accept(hf_model, "r1", ids)
    verifier = await d.open(messages)  # the engine thread is not running yet: nobody answers in time
    assert verifier.landing is None and d.fallbacks("engine_busy") == 1
    d.engine.start()  # now it answers the ask nobody waits for: those blocks go straight back
    try:
        for m in messages[1:]:
            verifier.add_message(m)
        d.sink.deliver(verifier)
        assert [o.token_id for o in await read_all(handle)] == reference_tokens(hf_model, ids, MAX_TOKENS)
        d.engine.release("r1")
        await d.blocks_back()
    finally:
        d.engine.shutdown()


async def test_a_burst_sharing_a_prompt_shares_the_blocks_placed_first_and_gives_the_received_copies_back(
        decoding, hf_model, ids):
    first, kv1, messages1 = await decoding.accept(hf_model, "r1", ids)
    second, kv2, messages2 = await decoding.accept(hf_model, "r2", ids)  # accepted before any holds the prompt
    v1, v2 = await decoding.open(messages1), await decoding.open(messages2)
    for verifier, messages in ((v1, messages1), (v2, messages2)):
        for m in messages[1:]:
            verifier.add_message(m)
    decoding.sink.deliver(v1)
    await asyncio.wait_for(first.events.get(), 10)  # its first token: it has joined, its full blocks are cached
    while first.seq.num_computed < len(ids):
        await asyncio.sleep(0.01)
    decoding.sink.deliver(v2)
    outputs = await read_all(second)
    assert [o.token_id for o in outputs] == reference_tokens(hf_model, ids, MAX_TOKENS)
    full = (len(ids) - 1) // BLOCK_SIZE  # the blocks it may share: the last prompt position is its own
    placed_first, placed_second = decoding.joined
    assert placed_second[:full] == placed_first[:full] and placed_second[full:] == v2.landing.block_ids[full:]
    assert decoding.writes == []
    await read_all(first)
    decoding.engine.release("r1")
    decoding.engine.release("r2")
    await decoding.blocks_back()


async def test_a_cache_of_another_model_is_refused_at_its_header_and_takes_no_blocks(decoding, hf_model, ids):
    handle, kv, messages = await decoding.accept(hf_model, "r1", ids)
    header = messages[0].header
    header.shape[1:] = [header.shape[2], header.shape[1]]  # kv heads and head size swapped
    with pytest.raises(KvTransferError, match=r"does not fit this worker's pool of \d+ layers of float32"):
        await decoding.open(messages)
    assert isinstance(await asyncio.wait_for(handle.events.get(), 5), KvTransferError)
    assert decoding.pool.stats().free_blocks == decoding.free_at_start
    decoding.engine.release("r1")


async def test_a_pool_off_the_host_receives_into_a_buffer_copied_at_join(decoding, runner, monkeypatch, hf_model, ids):
    handle, kv, messages = await decoding.accept(hf_model, "r1", ids)
    with monkeypatch.context() as on_a_gpu:  # only while the header is read: the forwards stay on the CPU
        on_a_gpu.setattr(runner, "device", torch.device("cuda"))
        verifier = await decoding.open(messages)
    assert verifier.landing is None and decoding.fallbacks("device") == 1
    assert decoding.pool.stats().free_blocks == decoding.free_at_start
    for m in messages[1:]:
        verifier.add_message(m)
    decoding.sink.deliver(verifier)
    assert [o.token_id for o in await read_all(handle)] == reference_tokens(hf_model, ids, MAX_TOKENS)
    assert len(decoding.writes) == 1
    decoding.engine.release("r1")
    await decoding.blocks_back()
