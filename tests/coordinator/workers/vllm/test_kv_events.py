"""vLLM's KV events (msgpack, vLLM's own hashes) made pdserve's KvEventBatches: the index then matches prompts
against a vLLM instance's cache as against a pdserve worker's."""

from __future__ import annotations

import msgpack

from coordinator.scheduling.kv_index import KvIndex
from coordinator.workers.vllm.kv_events import VllmEventTranslator

BS = 4
PROMPT = list(range(100, 113))  # three full blocks and a token


def stored(hashes, parent, token_ids, as_array=False, medium="GPU"):
    if as_array:
        return ["BlockStored", hashes, parent, token_ids, BS, None, medium]
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": token_ids,
            "block_size": BS, "lora_id": None, "medium": medium, "extra_keys": [None] * len(hashes)}


def message(*events) -> bytes:
    return msgpack.packb([1.0, list(events), None])


def feed(index: KvIndex, translator: VllmEventTranslator, seq: int, *events) -> None:
    for batch in translator.batch(seq, message(*events)):
        assert index.apply("vllm-1:8000", batch)


def test_stored_blocks_chained_over_several_events_match_the_prompt():
    index, translator = KvIndex(), VllmEventTranslator("prefill")
    feed(index, translator, 0, stored([b"h1", b"h2"], None, PROMPT[:8]))
    feed(index, translator, 1, stored([b"h3"], b"h2", PROMPT[8:12], as_array=True))
    assert index.match(PROMPT).prefill == {"vllm-1:8000": 12}
    assert index.match(PROMPT[:4] + [1, 2, 3, 4, 5]).prefill == {"vllm-1:8000": 4}


def test_removed_blocks_leave_the_index():
    index, translator = KvIndex(), VllmEventTranslator("decode")
    feed(index, translator, 0, stored([b"h1", b"h2", b"h3"], None, PROMPT[:12]))
    feed(index, translator, 1, {"type": "BlockRemoved", "block_hashes": [b"h2", b"unknown"], "medium": "GPU"})
    assert index.match(PROMPT).decode == {"vllm-1:8000": 4}


def test_blocks_vllm_offloads_to_the_cpu_are_indexed_as_tier_blocks():
    index, translator = KvIndex(), VllmEventTranslator("prefill")
    feed(index, translator, 0, stored([b"h1", b"h2", b"h3"], None, PROMPT[:12]))
    feed(index, translator, 1, stored([b"h2", b"h3"], b"h1", PROMPT[4:12], medium="CPU"))  # offloaded
    feed(index, translator, 2, ["BlockRemoved", [b"h2", b"h3"], "GPU"])  # then evicted from the GPU
    match = index.match(PROMPT)
    assert match.prefill == {"vllm-1:8000": 12} and match.tier == {"vllm-1:8000": 8}
    assert index.describe("vllm-1:8000")["tier_blocks"] == 2
    feed(index, translator, 3, {"type": "BlockRemoved", "block_hashes": [b"h3"], "medium": "CPU"})
    assert index.match(PROMPT).prefill == {"vllm-1:8000": 8}


def test_a_block_chained_to_one_never_seen_is_left_out():
    index, translator = KvIndex(), VllmEventTranslator("prefill")
    feed(index, translator, 0, stored([b"h1"], None, PROMPT[:4]))
    feed(index, translator, 1, stored([b"h9"], b"before-the-subscription", PROMPT[4:8]))
    assert index.blocks_of("vllm-1:8000") == 1


def test_a_gap_in_vllms_numbering_or_a_clear_starts_the_entries_over():
    index, translator = KvIndex(), VllmEventTranslator("prefill")
    feed(index, translator, 0, stored([b"h1", b"h2"], None, PROMPT[:8]))
    feed(index, translator, 5, stored([b"h5"], None, [1, 2, 3, 4]))  # 1 to 4 were lost
    assert index.blocks_of("vllm-1:8000") == 1
    feed(index, translator, 6, {"type": "AllBlocksCleared"})
    assert index.blocks_of("vllm-1:8000") == 0
    feed(index, translator, 7, stored([b"h1"], None, PROMPT[:4]))
    assert index.match(PROMPT).prefill == {"vllm-1:8000": 4}


def test_blocks_hashed_with_media_or_another_cache_group_are_left_out():
    index, translator = KvIndex(), VllmEventTranslator("prefill")
    feed(index, translator, 0, stored([b"h1"], None, PROMPT[:4]),
         {**stored([b"h2"], b"h1", PROMPT[4:8]), "extra_keys": [[("mm", "abc", 0)]]},
         {**stored([b"g1"], None, PROMPT[:4]), "group_idx": 1})
    assert index.blocks_of("vllm-1:8000") == 1


def test_blocks_stored_under_a_served_adapter_match_only_prompts_salted_with_its_identity():
    from kv_events.block_hash import lora_cache_tokens

    digests = {"a1": 11}
    index, translator = KvIndex(), VllmEventTranslator("prefill", digests.get)
    feed(index, translator, 0, {**stored([b"h1", b"h2"], None, PROMPT[:8]), "lora_name": "a1",
                                "extra_keys": [["a1"], ["a1"]]},
         {**stored([b"x1"], None, PROMPT[:4]), "lora_name": "not-served", "extra_keys": [["not-served"]]})
    assert index.match(lora_cache_tokens(PROMPT, 11)).prefill == {"vllm-1:8000": 8}
    assert index.match(PROMPT).prefill == {} and index.match(lora_cache_tokens(PROMPT, 12)).prefill == {}
    assert index.blocks_of("vllm-1:8000") == 2
