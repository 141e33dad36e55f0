"""ClusterFormats: a new format version stays off while any process lacks it, turns on once none does, a finalize
keeps it on and refuses older workers; the router pairs workers only on a KV layout both read."""

from __future__ import annotations

import pytest

from coordinator.cluster.replica_census import ReplicaCensus
from coordinator.cluster.wire_formats import ClusterFormats
from coordinator.errors import ApiError, WorkerError
from coordinator.scheduling.policies import RoundRobinPolicy
from coordinator.scheduling.router import Router
from coordinator.workers.instances import InstanceRegistry
from proto.wire_versions import FORMATS, PREVIOUS, RELEASE, THIS_PROCESS, FormatRange, WireVersions
from tests.coordinator.cluster.fake_store import FakeStore


def cluster(versions: dict[str, WireVersions]) -> tuple[InstanceRegistry, ClusterFormats]:
    registry = InstanceRegistry([a for a in versions if a.startswith("p")], [a for a in versions if a.startswith("d")])
    for role in ("prefill", "decode"):
        for instance in registry.instances(role):
            announce(registry, role, instance.address, versions[instance.address])
    return registry, ClusterFormats(registry)


def announce(registry: InstanceRegistry, role: str, address: str, versions: WireVersions) -> None:
    """A health answer from the instance, announcing `versions`."""
    registry.record_health(registry.get(role, address), None, draining=False, versions=versions)


def test_a_new_format_stays_off_while_any_worker_lacks_it_and_turns_on_once_none_does():
    registry, formats = cluster({"p1:1": THIS_PROCESS, "d1:1": PREVIOUS, "d2:1": THIS_PROCESS})
    assert formats.active("decode_request") == 1
    assert formats.version_with("decode_request", THIS_PROCESS) == 1
    announce(registry, "decode", "d1:1", THIS_PROCESS)  # upgraded in place
    assert formats.active("decode_request") == FORMATS["decode_request"].newest == 3
    assert formats.version_with("decode_request", PREVIOUS) == 1  # never more than the peer reads


def test_a_finalize_is_refused_while_a_process_is_older_and_then_keeps_new_formats_on_and_old_workers_out():
    registry, formats = cluster({"p1:1": PREVIOUS, "d1:1": THIS_PROCESS})
    with pytest.raises(ApiError) as refused:
        formats.finalize()
    assert refused.value.status == 409 and "prefill p1:1 (release 0.1.0)" in str(refused.value)
    assert formats.may_join(PREVIOUS) is None
    announce(registry, "prefill", "p1:1", THIS_PROCESS)
    assert formats.finalize() == RELEASE
    assert "finalized at release" in formats.may_join(PREVIOUS)
    announce(registry, "prefill", "p1:1", PREVIOUS)  # one that slipped in stays written to as it reads
    assert formats.active("decode_request") == 3 and formats.version_with("decode_request", PREVIOUS) == 1


def test_an_older_coordinator_replica_on_etcd_holds_new_formats_back():
    registry, formats = cluster({"d1:1": THIS_PROCESS})
    assert formats.active("decode_request") == 3
    formats.set_replicas({"old": PREVIOUS})
    assert formats.active("decode_request") == 1
    assert "coordinator old (release 0.1.0)" in formats.behind()


async def test_census_records_carry_each_replicas_release_and_a_bare_count_reads_as_the_previous_release():
    store = FakeStore()
    new, old = ReplicaCensus(store, "/p", "new", 3), ReplicaCensus(store, "/p", "other", 3)
    await old.round()
    await store.put("/p/replicas/legacy", "1")  # a replica of release 0.1.0 writes "1"
    await new.round()
    assert new.versions["other"].release == RELEASE and new.versions["other"].formats == dict(FORMATS)
    assert new.versions["legacy"] is PREVIOUS
    assert new.count == 3


def test_the_router_pairs_a_decode_worker_only_with_prefill_workers_that_write_a_kv_layout_it_reads():
    layout3 = WireVersions("9.0.0", {**FORMATS, "kv_layout": FormatRange(3, 3)})
    registry, _ = cluster({"p1:1": layout3, "p2:1": THIS_PROCESS, "d1:1": THIS_PROCESS})
    router = Router(registry, RoundRobinPolicy())
    assert {router.route([1, 2, 3]).prefill.address for _ in range(6)} == {"p2:1"}
    announce(registry, "prefill", "p2:1", layout3)
    with pytest.raises(WorkerError):
        router.route([1, 2, 3])


def test_images_are_named_to_an_encode_worker_only_once_every_worker_reads_embeddings_else_their_files_go():
    from coordinator.metrics import NullMetrics
    from coordinator.requests.attempt import AttemptRunner
    from coordinator.requests.request import GenerationRequest, MediaInput, SamplingOptions
    from coordinator.scheduling.router import Placement

    registry, formats = cluster({"p1:1": THIS_PROCESS, "p2:1": PREVIOUS, "d1:1": THIS_PROCESS})
    runner = AttemptRunner(None, registry, None, 10.0, NullMetrics())
    runner.formats = formats
    image = MediaInput("image", b"png", 7, 1, 16, "messages.0.content.0", encoder="e1:1")
    request = GenerationRequest("r", list(range(20)), SamplingOptions(), media=(image,))
    new, old, decode = registry.get("prefill", "p1:1"), registry.get("prefill", "p2:1"), registry.get("decode", "d1:1")
    # A 0.1.0 prefill worker in the cluster: every prefill worker gets the file, the new one too.
    assert runner._in_formats(request, Placement(new, decode)).media[0].encoder == ""
    assert runner._in_formats(request, Placement(old, decode)).media[0].encoder == ""
    registry.deregister("prefill", "p2:1")
    assert runner._in_formats(request, Placement(new, decode)).media[0].encoder == "e1:1"
    assert runner._in_formats(request, Placement(None, decode)).media[0].encoder == ""  # the decode worker prefills
