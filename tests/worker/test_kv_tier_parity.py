"""A prefill worker's KV tier through real processes: a prefix loaded back from disk, or recomputed when its file is
damaged, gives the same greedy tokens as transformers."""

from __future__ import annotations

import grpc
import pytest

from kv_events.block_hash import chain_hashes, hash_from_bytes
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from tests.helpers import greedy_completion, health, metrics_url, reference_tokens, scrape, start_coordinator, start_worker, wait_for, write_config

pytestmark = pytest.mark.system

BLOCK = 16
MAX_TOKENS = 8
# A pool of 6 blocks: each prompt below (~56 tokens) takes 4, so three other prompts push one out of the pool.
POOL_TOKENS = 96
TEXT = "keeps evicted blocks on local disk and loads them back when a prompt that starts the same way comes again."


@pytest.fixture(scope="module")
def tier_cluster(model_dir, tmp_path_factory):
    tier_dir = tmp_path_factory.mktemp("kv-tier")
    prefill = start_worker("prefill", model_dir, "--kv-budget-tokens", str(POOL_TOKENS), "--block-size", str(BLOCK),
                           "--kv-tier-dir", str(tier_dir), "--kv-tier-gb", "0.01")
    decode = start_worker("decode", model_dir, "--no-prefix-caching")
    config = write_config(tier_dir.parent / f"{tier_dir.name}.json", [prefill.address], [decode.address], model_dir)
    coordinator = start_coordinator(config)
    yield coordinator.address, prefill, tier_dir
    for proc in (coordinator, prefill, decode):
        proc.stop()


def complete(url: str, prompt: str) -> dict:
    return greedy_completion(url, prompt, MAX_TOKENS)


def metric(prefill, name: str) -> float:
    return scrape(metrics_url(prefill))[(name, ())]


def only_in_tier(prefill, prompt_ids: list[int]) -> bool:
    """Whether the worker's KV events snapshot has the prompt's cacheable blocks in its tier and none in its pool."""
    wanted = set(chain_hashes(prompt_ids[:-1], BLOCK))
    mediums: dict[int, set[int]] = {}
    with grpc.insecure_channel(prefill.address) as channel:
        call = pb_grpc.KvEventsStub(channel).Watch(pb.WatchKvEventsRequest(), timeout=10)
        for batch in call:
            for e in batch.events:
                mediums.setdefault(hash_from_bytes(e.hash), set()).add(e.medium)
            if not batch.snapshot or len(batch.events) < 8192:  # the snapshot's last batch
                break
        call.cancel()
    return all(mediums.get(h) == {1} for h in wanted)


def push_to_tier(url: str, prefill, tag: str) -> list[int]:
    """Send a prompt, then others until its blocks leave the pool for the tier; return its token ids."""
    prompt_ids = complete(url, f"The {tag} tier {TEXT}")["prompt_token_ids"]
    assert len(prompt_ids) - 1 >= 3 * BLOCK and len(prompt_ids) + MAX_TOKENS <= POOL_TOKENS
    for i in range(3):
        complete(url, f"{tag} filler {i}: the pool {TEXT}")
    wait_for(lambda: only_in_tier(prefill, prompt_ids), what=f"the {tag} prompt's blocks in the tier only")
    return prompt_ids


def test_a_prefix_loaded_back_from_the_tier_gives_the_same_greedy_tokens(tier_cluster, hf_model):
    url, prefill, _ = tier_cluster
    prompt_ids = push_to_tier(url, prefill, "first")
    assert metric(prefill, "pdserve_worker_kv_tier_blocks") > 0
    hits = metric(prefill, "pdserve_worker_kv_tier_hit_tokens_total")
    choice = complete(url, f"The first tier {TEXT}")
    assert choice["prompt_token_ids"] == prompt_ids
    assert choice["token_ids"] == reference_tokens(hf_model, prompt_ids, MAX_TOKENS)
    assert metric(prefill, "pdserve_worker_kv_tier_hit_tokens_total") - hits == (len(prompt_ids) - 1) // BLOCK * BLOCK
    reply = health(prefill.address, "prefill")  # what GET /v1/instances shows under `reported`
    assert reply.kv_tier_blocks > 0 and reply.tier_hit_tokens >= (len(prompt_ids) - 1) // BLOCK * BLOCK


def test_a_damaged_tier_file_is_recomputed_and_the_output_stays_the_same(tier_cluster, hf_model):
    url, prefill, tier_dir = tier_cluster
    prompt_ids = push_to_tier(url, prefill, "second")
    [tier_file] = tier_dir.glob("*.tier")
    size = tier_file.stat().st_size
    with open(tier_file, "r+b") as f:
        f.write(bytes(range(251)) * (size // 251) + bytes(size % 251))
    dropped = metric(prefill, "pdserve_worker_kv_tier_dropped_blocks_total")
    tier_hits = metric(prefill, "pdserve_worker_kv_tier_hit_tokens_total")
    choice = complete(url, f"The second tier {TEXT}")
    assert choice["token_ids"] == reference_tokens(hf_model, prompt_ids, MAX_TOKENS)
    assert metric(prefill, "pdserve_worker_kv_tier_dropped_blocks_total") > dropped
    assert metric(prefill, "pdserve_worker_kv_tier_hit_tokens_total") == tier_hits
