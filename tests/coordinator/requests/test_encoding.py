"""Where a request's images are encoded: the encode worker holding an image (the embeddings index, from encode
workers' KV events), else the least loaded routable one; and how the request then names its images' encoders.
Without any server: the registry and the index are the coordinator's own, fed as health checks and events would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from coordinator.requests.encoding import OUTCOMES, EncoderCounters, ImageEncoding
from coordinator.requests.request import GenerationRequest, MediaInput, SamplingOptions
from coordinator.scheduling.kv_index import KvIndex
from coordinator.workers.instances import InstanceRegistry, ReportedLoad
from kv_events.block_hash import hash_to_bytes, media_content_hash
from proto import worker_pb2 as pb

FILE_A, FILE_B = b"image a's file", b"image b's file"
A, B = media_content_hash(FILE_A), media_content_hash(FILE_B)


def image(data: bytes, offset: int = 1, num_tokens: int = 4, index: int = 0) -> MediaInput:
    return MediaInput("image", data, media_content_hash(data), offset, num_tokens, f"messages.0.content.{index}")


def held(index: KvIndex, address: str, hashes: list[int]) -> None:
    """`address`'s snapshot of its encoder cache, as its KV events bring it."""
    assert index.apply(address, pb.KvEventBatch(epoch="e", reset=True, snapshot=True, role="encode", block_size=1,
                                                events=[pb.KvBlockEvent(hash=hash_to_bytes(h), num_tokens=4)
                                                        for h in hashes]))


def encoding(*addresses: str) -> tuple[ImageEncoding, InstanceRegistry, KvIndex]:
    registry, index = InstanceRegistry(), KvIndex()
    for address in addresses:
        registry.register("encode", address)
        held(index, address, [])
    return ImageEncoding(None, registry, index, timeout_s=5), registry, index


def busy(registry: InstanceRegistry, address: str, outstanding: int = 0, waiting: int = 0, running: int = 0) -> None:
    instance = registry.get("encode", address)
    instance.outstanding_requests = outstanding
    instance.reported = ReportedLoad(num_running=running, num_waiting=waiting)


def fields(m: MediaInput) -> tuple:
    return (m.kind, m.data, m.content_hash, m.offset, m.num_tokens, m.source, m.encoder)


def request(*media: MediaInput) -> GenerationRequest:
    return GenerationRequest("r", [0] * 20, SamplingOptions(), media=media)


def test_the_encode_worker_holding_the_image_is_chosen_even_when_busier():
    images, registry, index = encoding("e0:1", "e1:1", "e2:1")
    busy(registry, "e1:1", outstanding=5, waiting=3, running=2)
    held(index, "e1:1", [A])
    assert images.choose(image(FILE_A), set()).address == "e1:1"
    assert images.choose(image(FILE_B), set()).address == "e0:1"  # nobody holds B: e1 is the busiest


def test_of_several_holding_the_image_the_least_loaded_is_chosen():
    images, registry, index = encoding("e0:1", "e1:1", "e2:1")
    held(index, "e0:1", [A])
    held(index, "e2:1", [A, B])
    busy(registry, "e0:1", waiting=2)
    assert images.choose(image(FILE_A), set()).address == "e2:1"


def test_without_a_holder_the_least_loaded_counts_outstanding_waiting_and_running():
    images, registry, _ = encoding("e0:1", "e1:1", "e2:1")
    busy(registry, "e0:1", outstanding=3)
    busy(registry, "e1:1", waiting=1, running=1)
    busy(registry, "e2:1", outstanding=1, running=1)
    assert images.choose(image(FILE_A), set()).address == "e1:1"  # load 2 against 3 and 2: by address
    busy(registry, "e1:1", waiting=2, running=1)
    assert images.choose(image(FILE_A), set()).address == "e2:1"
    busy(registry, "e2:1", running=4)
    assert images.choose(image(FILE_A), set()).address == "e0:1"
    busy(registry, "e0:1", outstanding=3, waiting=1)
    assert images.choose(image(FILE_A), set()).address == "e1:1"


def test_a_lease_on_an_encode_worker_counts_as_its_load():
    images, registry, _ = encoding("e0:1", "e1:1")
    with registry.lease(registry.get("encode", "e0:1")):
        assert images.choose(image(FILE_A), set()).address == "e1:1"
    with registry.lease(registry.get("encode", "e1:1")):
        assert images.choose(image(FILE_A), set()).address == "e0:1"


def test_excluded_and_unhealthy_encode_workers_are_skipped_even_when_holding_the_image():
    images, registry, index = encoding("e0:1", "e1:1", "e2:1")
    held(index, "e0:1", [A])
    held(index, "e1:1", [A])
    busy(registry, "e2:1", outstanding=9)
    assert images.choose(image(FILE_A), {"e0:1"}).address == "e1:1"
    registry.record_failure(registry.get("encode", "e1:1"), "UNAVAILABLE: gone", gone=True)
    assert images.choose(image(FILE_A), {"e0:1"}).address == "e2:1"
    registry.hold(registry.get("encode", "e2:1"))  # an operator's drain
    assert images.choose(image(FILE_A), set()).address == "e0:1"


def test_no_encode_worker_is_chosen_when_none_is_left():
    images, registry, index = encoding("e0:1", "e1:1")
    held(index, "e0:1", [A])
    assert images.choose(image(FILE_A), {"e0:1", "e1:1"}) is None
    registry.record_failure(registry.get("encode", "e1:1"), "UNAVAILABLE: gone", gone=True)
    assert images.choose(image(FILE_A), {"e0:1"}) is None


def test_workers_of_other_roles_are_never_chosen_to_encode():
    images, registry, index = encoding()
    registry.register("prefill", "p0:1")
    held(index, "p0:1", [A])  # a hash a prefill worker's pool held would not make it an encoder
    assert images.choose(image(FILE_A), set()) is None


def test_start_does_nothing_without_a_routable_encode_worker():
    images, registry, _ = encoding()
    registry.register("prefill", "p0:1")
    assert images.start(request(image(FILE_A)), deadline=0.0) is None
    images, registry, _ = encoding("e0:1")
    registry.record_failure(registry.get("encode", "e0:1"), "UNAVAILABLE: gone", gone=True)
    assert images.start(request(image(FILE_A)), deadline=0.0) is None


def test_start_does_nothing_without_images_that_carry_their_file():
    images, _, _ = encoding("e0:1")
    assert images.start(request(), deadline=0.0) is None
    identity_only = MediaInput("image", b"", A, 1, 4, "messages.0.content.0")  # a decode-side copy: no file
    assert images.start(request(identity_only), deadline=0.0) is None


def test_with_encoders_names_each_image_by_content_hash_and_an_empty_map_clears_them():
    first, second, again = image(FILE_A, 1, 4, 0), image(FILE_B, 6, 4, 1), image(FILE_A, 12, 4, 2)
    original = request(first, second, again)
    named = original.with_encoders({A: "e0:1"})
    assert [m.encoder for m in named.media] == ["e0:1", "", "e0:1"]
    assert [m.data for m in named.media] == [FILE_A, FILE_B, FILE_A]  # the files stay, for a fallback
    assert [m.encoder for m in original.media] == ["", "", ""]
    both = named.with_encoders({A: "e0:1", B: "e1:1", 12345: "e2:1"})
    assert [m.encoder for m in both.media] == ["e0:1", "e1:1", "e0:1"]
    cleared = both.with_encoders({})
    assert [m.encoder for m in cleared.media] == ["", "", ""]
    assert [fields(m) for m in cleared.media] == [fields(m) for m in original.media]
    assert cleared.prompt_token_ids == original.prompt_token_ids and cleared.request_id == original.request_id


def test_with_encoders_leaves_a_request_without_images_as_it_is():
    plain = request()
    assert plain.with_encoders({A: "e0:1"}) is plain and plain.with_encoders({}) is plain


def test_encoder_counters_count_each_outcome_from_zero():
    metrics = CollectorRegistry()
    counters = EncoderCounters(metrics)

    def value(outcome: str) -> float:
        return metrics.get_sample_value("pdserve_encoder_images_total", {"outcome": outcome})

    assert {outcome: value(outcome) for outcome in OUTCOMES} == dict.fromkeys(OUTCOMES, 0.0)
    counters.count("cached")
    counters.count("fallback", 3)
    counters.count("encoded", 0)
    assert {outcome: value(outcome) for outcome in OUTCOMES} == {"cached": 1.0, "encoded": 0.0, "fallback": 3.0,
                                                                 "pull_failed": 0.0}
    EncoderCounters().count("cached")  # without a metrics registry: counts nothing, raises nothing
