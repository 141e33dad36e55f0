"""Wire versions: the release announced in health answers, a silent process taken as the previous release, and
the newest common version of two ranges."""

from __future__ import annotations

import tomllib
from pathlib import Path

from kv_transfer.wire import KV_LAYOUT_VERSION
from proto import worker_pb2 as pb
from proto.wire_versions import (FORMATS, PREVIOUS, PREVIOUS_FORMATS, RELEASE, FormatRange, add_to_health,
                                 from_health, release_key)

REPO = Path(__file__).resolve().parents[2]


def test_the_release_is_pyprojects_version_and_the_kv_layout_is_the_one_the_workers_write():
    assert RELEASE == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert FORMATS["kv_layout"] == FormatRange(KV_LAYOUT_VERSION, KV_LAYOUT_VERSION)


def test_a_health_answer_carries_the_release_and_every_format_range_and_reads_back_the_same():
    versions = from_health(pb.HealthResponse.FromString(add_to_health(pb.HealthResponse()).SerializeToString()))
    assert versions.release == RELEASE and versions.announced
    assert dict(versions.formats) == dict(FORMATS)


def test_a_worker_that_announces_nothing_is_the_previous_release_with_its_formats():
    versions = from_health(pb.HealthResponse(role="decode"))
    assert versions is PREVIOUS and not versions.announced
    assert versions.range("decode_request") == FormatRange(1, 1) == PREVIOUS_FORMATS["decode_request"]


def test_a_format_a_process_does_not_name_is_read_as_the_previous_releases_range():
    versions = from_health(pb.HealthResponse(release="9.0.0", wire_formats=[pb.WireFormatRange(
        name="kv_layout", oldest=2, newest=3)]))
    assert versions.range("kv_layout") == FormatRange(2, 3)
    assert versions.range("token_records") == PREVIOUS_FORMATS["token_records"]


def test_two_ranges_pair_on_their_newest_common_version_or_not_at_all():
    assert FormatRange(1, 3).common_newest(FormatRange(2, 5)) == 3
    assert FormatRange(2, 2).common_newest(FormatRange(2, 2)) == 2
    assert FormatRange(1, 1).common_newest(FormatRange(2, 3)) is None


def test_releases_compare_by_number_not_by_text():
    assert release_key("0.10.0") > release_key("0.9.1") > release_key("0.2.0") > release_key("0.1.0")


def test_the_previous_release_reads_no_embeddings_and_this_one_reads_version_1():
    from proto.wire_versions import THIS_PROCESS, WireVersions

    assert PREVIOUS.range("embeddings").newest == 0
    assert WireVersions("0.1.0", {}, announced=False).range("embeddings") == FormatRange(0, 0)
    assert from_health(pb.HealthResponse(role="prefill")).range("embeddings").newest == 0
    assert THIS_PROCESS.range("embeddings") == FormatRange(0, 1)
    announced = from_health(pb.HealthResponse.FromString(add_to_health(pb.HealthResponse()).SerializeToString()))
    assert announced.range("embeddings").newest == 1
    # a pair of this release and the previous one sends no encoder names: the files
    assert THIS_PROCESS.range("embeddings").common_newest(PREVIOUS.range("embeddings")) == 0
