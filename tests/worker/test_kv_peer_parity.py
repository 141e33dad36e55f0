"""Peer pulls through real processes: a prefill worker that lost a prompt's leading blocks pulls them from the decode
worker that still holds them (KvPeer.PullKv), caches them, computes only the rest, and gives the same greedy tokens
as transformers."""

from __future__ import annotations

import grpc
import pytest

from kv_events.block_hash import chain_hashes, hash_from_bytes
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from tests.helpers import (greedy_completion, health, index_matches_workers, metrics_url, reference_tokens, scrape, start_coordinator,
                           start_worker, wait_for, write_config)

pytestmark = pytest.mark.system

BLOCK = 16
MAX_TOKENS = 8
# The prefill worker's pool: 6 blocks. Each prompt below (~56 tokens) takes 4, so three others push one out of it;
# the decode worker's default pool keeps every prompt it was sent.
POOL_TOKENS = 96
TEXT = ("is pulled from the decode worker that still holds it, when the prefill worker has lost it to other "
        "prompts, over the network.")


@pytest.fixture(scope="module")
def peer_cluster(model_dir, tmp_path_factory):
    prefill = start_worker("prefill", model_dir, "--kv-budget-tokens", str(POOL_TOKENS), "--block-size", str(BLOCK))
    decode = start_worker("decode", model_dir, "--block-size", str(BLOCK))
    config = write_config(tmp_path_factory.mktemp("kv-peer") / "ms_coordinator.json", [prefill.address],
                          [decode.address], model_dir,
                          sections={"digs_scheduler_config": {"algorithm_type": "cache_affinity",
                                                              "cache_affinity_pull_min_tokens": 32}})
    coordinator = start_coordinator(config)
    yield coordinator, prefill, decode
    for proc in (coordinator, prefill, decode):
        proc.stop()


def complete(url: str, prompt: str) -> dict:
    return greedy_completion(url, prompt, MAX_TOKENS)


def pulls(worker, outcome: str, name: str = "pdserve_worker_kv_pulls_total") -> float:
    """A pull counter of the worker (0 before its first pull of that outcome: the labelled sample is not there)."""
    return scrape(metrics_url(worker)).get((name, (("outcome", outcome),)), 0.0)


def pool_blocks(worker) -> set[int]:
    """The block hashes the worker's KV events snapshot has in its pool (medium 0)."""
    held: set[int] = set()
    with grpc.insecure_channel(worker.address) as channel:
        call = pb_grpc.KvEventsStub(channel).Watch(pb.WatchKvEventsRequest(), timeout=10)
        for batch in call:
            held.update(hash_from_bytes(e.hash) for e in batch.events if not e.medium and not e.removed)
            if not batch.snapshot or len(batch.events) < 8192:  # the snapshot's last batch
                break
        call.cancel()
    return held


def lost_by_prefill_only(coordinator, prefill, decode, prompt_ids: list[int]) -> bool:
    """The prefill worker no longer holds the prompt's first block, the decode worker holds all its cacheable ones,
    and the coordinator's index says the same of both."""
    wanted = chain_hashes(prompt_ids[:-1], BLOCK)
    return (wanted[0] not in pool_blocks(prefill) and set(wanted) <= pool_blocks(decode)
            and index_matches_workers(coordinator, [prefill, decode]) is not None)


def pull_again(peer_cluster, hf_model, tag: str) -> list[int]:
    """Send a prompt, others until the prefill worker lost its first block (the decode worker keeps it), then the
    prompt again: checks its greedy tokens and that its leading blocks were pulled; returns its token ids."""
    coordinator, prefill, decode = peer_cluster
    url = coordinator.address
    prompt = f"The {tag} prefix {TEXT}"
    prompt_ids = complete(url, prompt)["prompt_token_ids"]
    assert len(prompt_ids) - 1 >= 3 * BLOCK and len(prompt_ids) + MAX_TOKENS <= POOL_TOKENS
    for i in range(3):
        complete(url, f"{tag} filler {i}: the pool {TEXT}")
    wait_for(lambda: lost_by_prefill_only(coordinator, prefill, decode, prompt_ids),
             what=f"the {tag} prompt's first block gone from the prefill worker only")

    before = {(w.address, o, n): pulls(w, o, n) for w in (prefill, decode) for o in ("pulled", "failed", "served")
              for n in ("pdserve_worker_kv_pulls_total", "pdserve_worker_kv_pull_bytes_total")}
    reported = health(prefill.address, "prefill")
    hits = reported.prefix_hit_tokens
    choice = complete(url, prompt)
    assert choice["prompt_token_ids"] == prompt_ids
    assert choice["token_ids"] == reference_tokens(hf_model, prompt_ids, MAX_TOKENS)

    def grown(worker, outcome, name="pdserve_worker_kv_pulls_total"):
        return pulls(worker, outcome, name) - before[(worker.address, outcome, name)]

    assert grown(prefill, "pulled") == 1
    assert grown(prefill, "failed") == 0
    wait_for(lambda: grown(decode, "served") == 1, what="the decode worker's served pull counted")
    pulled_bytes = grown(prefill, "pulled", "pdserve_worker_kv_pull_bytes_total")
    assert pulled_bytes > 0
    assert pulled_bytes == grown(decode, "served", "pdserve_worker_kv_pull_bytes_total")
    # The pulled blocks were found cached by the prefill that followed: it computed only the rest.
    cacheable = (len(prompt_ids) - 1) // BLOCK * BLOCK
    after = health(prefill.address, "prefill")  # what GET /v1/instances shows under `reported`
    assert after.prefix_hit_tokens - hits == cacheable
    assert after.kv_pulls - reported.kv_pulls == 1 and after.kv_pulled_bytes - reported.kv_pulled_bytes == pulled_bytes
    return prompt_ids


def test_a_prefix_pulled_from_the_decode_worker_gives_the_same_greedy_tokens(peer_cluster, hf_model):
    pull_again(peer_cluster, hf_model, "first")


def test_the_pulled_blocks_stay_in_the_prefill_workers_cache(peer_cluster, hf_model):
    coordinator, prefill, decode = peer_cluster
    prompt_ids = pull_again(peer_cluster, hf_model, "second")
    wanted = set(chain_hashes(prompt_ids[:-1], BLOCK))
    assert wanted <= pool_blocks(prefill)
    # ... and the coordinator's index learnt it from the prefill worker's KV events.
    wait_for(lambda: index_matches_workers(coordinator, [prefill, decode]), what="the index to match the workers")
