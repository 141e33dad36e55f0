"""The local connector's choice of actions: switch when one role is over and the other under, start what is short,
stop one at a time, never the last worker of a role."""

from __future__ import annotations

import json

from launcher.autoscaler import next_actions
from launcher.local_cluster import ClusterOptions, _cluster_config
from launcher.supervisor import Child


def fleet(*roles_and_load: tuple[str, int]) -> tuple[dict, dict]:
    """Workers (ready and registered) of these roles with these outstanding requests, and the coordinator's list."""
    workers, listed = {}, {"prefill": {}, "decode": {}, "encode": {}}
    for i, (role, load) in enumerate(roles_and_load):
        child = Child(f"{role} worker {i}", ["pdserve", "worker", "--role", role], "ready", address=f"127.0.0.1:{i}",
                      ready_at=1.0)
        workers[child] = role
        listed[role][child.address] = {"outstanding_requests": load}
    return workers, listed


def kinds(actions) -> list[tuple[str, str | None, str]]:
    return [(kind, child.address if child else None, role) for kind, child, role in actions]


def test_a_role_over_and_the_other_under_switches_the_least_busy_workers():
    workers, listed = fleet(("prefill", 5), ("prefill", 0), ("prefill", 2), ("decode", 1))
    actions = next_actions({"prefill": 1, "decode": 3}, workers, listed, max_workers=4)
    assert kinds(actions) == [("switch", "127.0.0.1:1", "decode"), ("switch", "127.0.0.1:2", "decode")]


def test_a_switch_never_takes_the_last_worker_of_a_role():
    workers, listed = fleet(("prefill", 0), ("decode", 0))
    assert next_actions({"prefill": 0, "decode": 2}, workers, listed, max_workers=2) == []


def test_what_is_short_is_started_up_to_the_most_workers_the_role_most_short_first():
    workers, listed = fleet(("prefill", 0), ("decode", 0))
    actions = next_actions({"prefill": 2, "decode": 3}, workers, listed, max_workers=5)
    assert kinds(actions) == [("start", None, "decode"), ("start", None, "decode"), ("start", None, "prefill")]
    actions = next_actions({"prefill": 2, "decode": 4}, workers, listed, max_workers=4)
    assert kinds(actions) == [("start", None, "decode"), ("start", None, "decode")]
    full, full_listed = fleet(("prefill", 0), ("decode", 0))
    assert next_actions({"prefill": 2, "decode": 2}, full, full_listed, max_workers=2) == []


def test_a_role_over_with_none_under_stops_its_least_busy_worker_alone():
    workers, listed = fleet(("prefill", 3), ("prefill", 1), ("prefill", 2), ("decode", 0))
    actions = next_actions({"prefill": 1, "decode": 1}, workers, listed, max_workers=4)
    assert kinds(actions) == [("stop", "127.0.0.1:1", "prefill")]


def test_a_worker_not_yet_listed_by_the_coordinator_is_not_switched_or_stopped():
    workers, listed = fleet(("prefill", 0), ("prefill", 0), ("decode", 0))
    del listed["prefill"]["127.0.0.1:0"], listed["prefill"]["127.0.0.1:1"]
    assert next_actions({"prefill": 1, "decode": 2}, workers, listed, max_workers=3) == []


def test_the_desired_split_already_running_needs_nothing():
    workers, listed = fleet(("prefill", 0), ("decode", 0), ("decode", 0))
    assert next_actions({"prefill": 1, "decode": 2}, workers, listed, max_workers=6) == []


class _NoSecurity:
    def coordinator_sections(self) -> dict:
        return {}


def test_autoscale_turns_the_planner_and_decode_rebalancing_on_even_over_a_config_that_has_them_off(tmp_path):
    config = tmp_path / "ms_coordinator.json"
    config.write_text(json.dumps({"rebalance_config": {"enabled": False, "min_imbalance": 6},
                                  "planner_config": {"enabled": False}}))
    scaled = _cluster_config(ClusterOptions(config=str(config), autoscale=True, max_workers=5), [], [], "",
                             _NoSecurity())
    assert scaled["planner_config"]["enabled"] and scaled["planner_config"]["max_instances"] == 5
    assert scaled["rebalance_config"]["enabled"] and scaled["rebalance_config"]["min_imbalance"] == 6
    plain = _cluster_config(ClusterOptions(config=str(config)), [], [], "", _NoSecurity())
    assert not plain["planner_config"]["enabled"] and not plain["rebalance_config"]["enabled"]


def test_encode_workers_are_started_and_stopped_to_the_planners_count_never_switched():
    workers, listed = fleet(("prefill", 0), ("decode", 0), ("encode", 0))
    assert kinds(next_actions({"prefill": 1, "decode": 1, "encode": 3}, workers, listed, max_workers=5)) == [
        ("start", None, "encode"), ("start", None, "encode")]
    workers, listed = fleet(("prefill", 0), ("decode", 0), ("encode", 4), ("encode", 1))
    assert kinds(next_actions({"prefill": 1, "decode": 1, "encode": 1}, workers, listed, max_workers=4)) == [
        ("stop", "127.0.0.1:3", "encode")]
    # Decode short and encode over: an encode worker holds no language model, so it is stopped, not switched.
    workers, listed = fleet(("prefill", 0), ("decode", 0), ("encode", 0), ("encode", 0))
    assert kinds(next_actions({"prefill": 1, "decode": 2, "encode": 1}, workers, listed, max_workers=4)) == [
        ("stop", "127.0.0.1:2", "encode")]


def test_a_plan_without_an_encode_count_leaves_the_encode_workers_alone():
    workers, listed = fleet(("prefill", 0), ("decode", 0), ("encode", 0), ("encode", 0))
    assert next_actions({"prefill": 1, "decode": 1}, workers, listed, max_workers=4) == []
