"""The KV index holds exactly what the workers' KV events say, and matches prompts against it."""

from __future__ import annotations

from coordinator.scheduling.kv_index import KvIndex
from proto import worker_pb2 as pb
from tests.helpers import kv_blocks_batch


def prompt(length: int, start: int = 0) -> list[int]:
    return list(range(start, start + length))


def test_a_prompt_matches_the_leading_blocks_each_instance_holds_by_role():
    index = KvIndex()
    assert index.apply("p0:1", kv_blocks_batch("prefill", prompt(48)))
    assert index.apply("p1:1", kv_blocks_batch("prefill", prompt(16)))
    assert index.apply("d0:1", kv_blocks_batch("decode", prompt(32)))
    assert index.apply("p2:1", kv_blocks_batch("prefill", prompt(48, start=500)))
    match = index.match(prompt(100))
    assert match.prefill == {"p0:1": 48, "p1:1": 16}
    assert match.decode == {"d0:1": 32}
    assert index.match(prompt(100, start=7)).prefill == {}


def test_the_last_prompt_token_is_never_counted_as_cached():
    index = KvIndex()
    index.apply("p0:1", kv_blocks_batch("prefill", prompt(32)))
    assert index.match(prompt(32)).prefill == {"p0:1": 16}  # the worker computes token 32 itself
    assert index.match(prompt(33)).prefill == {"p0:1": 32}


def test_a_removed_block_ends_the_match_there_even_if_later_ones_are_held():
    index = KvIndex()
    index.apply("p0:1", kv_blocks_batch("prefill", prompt(64)))
    removed = kv_blocks_batch("prefill", prompt(32), seq=1, reset=False, removed=True)
    del removed.events[0]  # only block 1 of 0..3 goes
    assert index.apply("p0:1", removed)
    assert index.match(prompt(80)).prefill == {"p0:1": 16}
    assert index.blocks_of("p0:1") == 3


def test_changes_apply_in_number_order_and_a_gap_drops_the_instance():
    index = KvIndex()
    index.apply("d0:1", kv_blocks_batch("decode", [], seq=5))
    assert index.apply("d0:1", kv_blocks_batch("decode", prompt(32), seq=7, reset=False))
    assert index.match(prompt(40)).decode == {"d0:1": 32}
    assert not index.apply("d0:1", kv_blocks_batch("decode", prompt(64), seq=12, reset=False))  # 8..10 missing
    assert index.match(prompt(40)).decode == {} and index.describe("d0:1") is None


def test_a_batch_without_a_block_size_is_refused():
    index = KvIndex()
    index.apply("p0:1", kv_blocks_batch("prefill", list(range(32))))
    assert not index.apply("p0:1", pb.KvEventBatch(epoch="epoch-1", reset=True, snapshot=True, role="prefill"))
    assert index.describe("p0:1") is None and index.match(list(range(40))).prefill == {}


def test_changes_without_a_snapshot_or_from_another_epoch_are_refused():
    index = KvIndex()
    assert not index.apply("d0:1", kv_blocks_batch("decode", prompt(32), seq=2, reset=False))
    index.apply("d0:1", kv_blocks_batch("decode", [], epoch="a"))
    assert not index.apply("d0:1", kv_blocks_batch("decode", prompt(32), epoch="b", seq=2, reset=False))


def test_a_new_snapshot_replaces_what_was_held():
    index = KvIndex()
    index.apply("p0:1", kv_blocks_batch("prefill", prompt(64)))
    index.apply("p0:1", kv_blocks_batch("prefill", prompt(32, start=900), epoch="restarted"))
    assert index.match(prompt(80)).prefill == {}
    assert index.describe("p0:1")["blocks"] == 2 and index.describe("p0:1")["epoch"] == "restarted"


def test_dropping_an_instance_forgets_only_its_blocks_and_frees_its_slot():
    index = KvIndex()
    index.apply("p0:1", kv_blocks_batch("prefill", prompt(48)))
    index.apply("p1:1", kv_blocks_batch("prefill", prompt(48)))
    index.drop("p0:1")
    assert index.match(prompt(60)).prefill == {"p1:1": 48}
    index.apply("p9:1", kv_blocks_batch("prefill", prompt(16)))  # takes the freed slot
    assert index.match(prompt(60)).prefill == {"p1:1": 48, "p9:1": 16}


def test_instances_with_other_block_sizes_are_matched_in_their_own_blocks():
    index = KvIndex()
    index.apply("p0:1", kv_blocks_batch("prefill", prompt(64), block_size=16))
    index.apply("p1:1", kv_blocks_batch("prefill", prompt(64), block_size=32))
    assert index.match(prompt(70)).prefill == {"p0:1": 64, "p1:1": 64}
    assert index.match(prompt(50)).prefill == {"p0:1": 48, "p1:1": 32}


def test_the_digest_depends_on_the_blocks_held_not_on_their_order():
    a, b = KvIndex(), KvIndex()
    a.apply("p0:1", kv_blocks_batch("prefill", prompt(64)))
    batch = kv_blocks_batch("prefill", prompt(64))
    batch.events.reverse()
    b.apply("p0:1", batch)
    assert a.describe("p0:1")["digest"] == b.describe("p0:1")["digest"]
    b.apply("p0:1", kv_blocks_batch("prefill", prompt(16, start=3), seq=1, reset=False))
    assert a.describe("p0:1")["digest"] != b.describe("p0:1")["digest"]


def test_a_prompt_with_an_image_matches_the_worker_that_computed_that_image_and_no_other():
    from coordinator.requests.request import GenerationRequest, MediaInput, SamplingOptions
    from worker.engine.media import MediaSpan, cache_token_ids

    ids = prompt(8) + [99] * 16 + prompt(24, start=200)  # an image's 16 placeholders at position 8

    def request(content_hash: int) -> GenerationRequest:
        image = MediaInput("image", b"", content_hash, 8, 16, "messages.0.content.0")
        return GenerationRequest("r", ids, SamplingOptions(), media=(image,))

    index = KvIndex()
    # What the worker's block pool registers: its own hashing of the same prompt and image.
    held = cache_token_ids(ids, (MediaSpan("image", 1234, 8, 16),))
    assert index.apply("p0:1", kv_blocks_batch("prefill", held))
    assert index.match(request(1234).cache_token_ids()).prefill == {"p0:1": 32}
    assert index.match(request(4321).cache_token_ids()).prefill == {}  # the same placeholders, another image
    assert index.match(ids).prefill == {}  # nor do the bare placeholder ids


def test_the_index_knows_each_block_medium_and_counts_tier_only_tokens():
    index = KvIndex()
    index.apply("p0:1", kv_blocks_batch("prefill", prompt(32)))
    tier_batch = kv_blocks_batch("prefill", prompt(64), reset=False, seq=4, medium=1)
    index.apply("p0:1", tier_batch)  # all four blocks in the tier, the first two in the pool too
    match = index.match(prompt(65))
    assert match.prefill == {"p0:1": 64} and match.tier == {"p0:1": 32}
    assert index.describe("p0:1")["tier_blocks"] == 4 and index.blocks_of("p0:1", "tier") == 4
    index.apply("p0:1", kv_blocks_batch("prefill", prompt(64), reset=False, seq=8, removed=True, medium=1))
    assert index.match(prompt(65)).prefill == {"p0:1": 32} and index.match(prompt(65)).tier == {}


def test_a_just_routed_prompt_is_expected_until_events_confirm_it_or_it_expires(monkeypatch):
    import coordinator.scheduling.kv_index as kv_index

    now = [1000.0]
    monkeypatch.setattr(kv_index.time, "monotonic", lambda: now[0])
    index = KvIndex(expected_ttl_s=5)
    index.apply("p0:1", kv_blocks_batch("prefill", []))
    index.expect(["p0:1"], prompt(49))
    assert index.match(prompt(49)).prefill == {"p0:1": 48}
    assert index.match(prompt(49)).expected == {"p0:1": 48}
    index.apply("p0:1", kv_blocks_batch("prefill", prompt(32), reset=False, seq=2))  # two blocks confirmed
    assert index.match(prompt(49)).expected == {"p0:1": 16}
    now[0] += 6
    assert index.match(prompt(49)).prefill == {"p0:1": 32}  # the unconfirmed block expired
    assert index.match(prompt(49)).expected == {}


def test_an_instance_dropped_leaves_no_expected_entries_for_the_next_in_its_slot():
    index = KvIndex(expected_ttl_s=60)
    index.apply("p0:1", kv_blocks_batch("prefill", []))
    index.expect(["p0:1"], prompt(49))
    index.drop("p0:1")
    index.apply("p9:1", kv_blocks_batch("prefill", []))  # takes the freed slot
    assert index.match(prompt(49)).prefill == {}


def test_an_expected_entry_lives_its_own_lifetime_whatever_other_instances_expect(monkeypatch):
    import coordinator.scheduling.kv_index as kv_index

    now = [1000.0]
    monkeypatch.setattr(kv_index.time, "monotonic", lambda: now[0])
    index = KvIndex(expected_ttl_s=10)
    for address in ("p0:1", "p1:1"):
        index.apply(address, kv_blocks_batch("prefill", []))
    index.expect(["p0:1"], prompt(33))  # its request then fails: nothing confirms it
    now[0] += 9
    index.expect(["p1:1"], prompt(33))
    now[0] += 2  # p0's lifetime is over, p1's is not
    assert index.match(prompt(33)).prefill == {"p1:1": 32}


def images_batch(hashes: list[int], seq: int = 0, reset: bool = True, removed: bool = False,
                 medium: int = 0) -> pb.KvEventBatch:
    """An encode worker's events: one per image (its content hash), as its encoder cache announces them."""
    from kv_events.block_hash import hash_to_bytes

    events = [pb.KvBlockEvent(hash=hash_to_bytes(h), removed=True, medium=medium) if removed
              else pb.KvBlockEvent(hash=hash_to_bytes(h), num_tokens=64, medium=medium) for h in hashes]
    return pb.KvEventBatch(epoch="epoch-1", seq=seq, reset=reset, snapshot=reset, role="encode", block_size=1,
                           events=events)


IMAGE_A, IMAGE_B = 0xA1 << 100, 0xB2 << 100


def test_holders_lists_exactly_the_instances_whose_pool_holds_an_image():
    index = KvIndex()
    assert index.holders(IMAGE_A) == []
    assert index.apply("e0:1", images_batch([IMAGE_A]))
    assert index.apply("e1:1", images_batch([]))
    assert index.apply("e2:1", images_batch([IMAGE_B]))
    assert index.holders(IMAGE_A) == ["e0:1"] and index.holders(IMAGE_B) == ["e2:1"]
    assert index.apply("e1:1", images_batch([IMAGE_A, IMAGE_B], seq=2, reset=False))
    assert sorted(index.holders(IMAGE_A)) == ["e0:1", "e1:1"]
    assert sorted(index.holders(IMAGE_B)) == ["e1:1", "e2:1"]


def test_holders_forgets_an_image_once_removed_there_and_an_instance_once_dropped():
    index = KvIndex()
    index.apply("e0:1", images_batch([IMAGE_A, IMAGE_B]))
    index.apply("e1:1", images_batch([IMAGE_A]))
    assert index.apply("e0:1", images_batch([IMAGE_A], seq=1, reset=False, removed=True))
    assert index.holders(IMAGE_A) == ["e1:1"] and index.holders(IMAGE_B) == ["e0:1"]
    index.drop("e1:1")
    assert index.holders(IMAGE_A) == [] and index.holders(IMAGE_B) == ["e0:1"]
    index.apply("e9:1", images_batch([IMAGE_B]))  # takes e1's freed slot
    assert index.holders(IMAGE_A) == [] and sorted(index.holders(IMAGE_B)) == ["e0:1", "e9:1"]


def test_holders_counts_the_pool_only_not_a_tier():
    index = KvIndex()
    index.apply("e0:1", images_batch([]))
    index.apply("e0:1", images_batch([IMAGE_A], seq=1, reset=False, medium=1))
    assert index.holders(IMAGE_A) == []


def test_an_encode_workers_images_match_no_prompt():
    index = KvIndex()
    index.apply("p0:1", kv_blocks_batch("prefill", prompt(32)))
    index.apply("e0:1", images_batch([IMAGE_A, IMAGE_B]))
    match = index.match(prompt(40))
    assert match.prefill == {"p0:1": 32} and match.decode == {}
