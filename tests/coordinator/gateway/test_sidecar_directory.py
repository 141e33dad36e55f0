"""SidecarDirectory: announced sidecars until their TTL lapses, withdrawals, and sidecars found by port."""

from __future__ import annotations

from coordinator.gateway.sidecar_directory import SidecarDirectory
from tests.helpers import FakeClock


def test_an_announced_sidecar_is_picked_until_its_ttl_lapses_and_announcing_again_renews_it():
    clock = FakeClock()
    directory = SidecarDirectory(ttl_s=15, clock=clock)
    directory.announce("10.0.0.1:9000", "10.0.0.1:8000")
    assert directory.endpoint_of("10.0.0.1:9000") == "10.0.0.1:8000"
    assert directory.decode_of("10.0.0.1:8000") == "10.0.0.1:9000"
    clock.now += 14
    directory.announce("10.0.0.1:9000", "10.0.0.1:8000")
    clock.now += 14
    assert directory.endpoint_of("10.0.0.1:9000") == "10.0.0.1:8000"
    clock.now += 2
    assert directory.endpoint_of("10.0.0.1:9000") is None
    assert directory.describe() == [{"decode": "10.0.0.1:9000", "endpoint": "10.0.0.1:8000", "age_s": 16.0,
                                     "live": False}]


def test_a_withdrawal_names_the_endpoint_it_announced_and_a_moved_sidecar_replaces_the_old_one():
    directory = SidecarDirectory(ttl_s=15, clock=FakeClock())
    directory.announce("10.0.0.1:9000", "10.0.0.1:8000")
    directory.announce("10.0.0.1:9000", "10.0.0.1:8001")
    assert directory.decode_of("10.0.0.1:8000") is None
    assert not directory.withdraw("10.0.0.1:9000", "10.0.0.1:8000")
    assert directory.withdraw("10.0.0.1:9000", "10.0.0.1:8001")
    assert directory.endpoint_of("10.0.0.1:9000") is None


def test_without_an_announcement_the_sidecar_port_on_the_workers_host_is_used():
    directory = SidecarDirectory(ttl_s=15, sidecar_port=8000, clock=FakeClock())
    assert directory.endpoint_of("10.0.0.7:9000") == "10.0.0.7:8000"
    assert SidecarDirectory(ttl_s=15).endpoint_of("10.0.0.7:9000") is None


def test_a_sidecar_the_gateway_reports_serving_stays_picked_without_announcing():
    clock = FakeClock()
    directory = SidecarDirectory(ttl_s=15, clock=clock)
    directory.announce("10.0.0.1:9000", "10.0.0.1:8000")
    clock.now += 14
    directory.heard_from("10.0.0.1:8000")
    directory.heard_from("10.0.0.9:8000")  # never announced: nothing to renew
    clock.now += 14
    assert directory.endpoint_of("10.0.0.1:9000") == "10.0.0.1:8000"
    assert directory.decode_of("10.0.0.9:8000") is None
