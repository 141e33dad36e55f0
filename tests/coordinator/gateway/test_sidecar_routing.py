"""A sidecar's placement: its own decode worker, the prefill worker the gateway named, or the decode worker alone."""

from __future__ import annotations

import pytest

from coordinator.config import ConfigError, parse_config
from coordinator.errors import WorkerError
from coordinator.errors import ApiError
from coordinator.gateway.sidecar import named_prefill, sidecar_settings
from coordinator.scheduling.policies import RoundRobinPolicy
from coordinator.requests.request import NamedPrefill
from coordinator.scheduling.router import Router
from coordinator.workers.instances import InstanceRegistry, InstanceState


def router() -> Router:
    return Router(InstanceRegistry([], ["10.0.0.1:9000"]), RoundRobinPolicy(), local_prefill_max_tokens=0)


def test_the_named_prefill_worker_is_added_on_first_sight_and_used():
    r = router()
    placement = r.route([1, 2, 3], prefill_at=NamedPrefill("10.0.0.2:7000"))
    assert placement.prefill.address == "10.0.0.2:7000" and placement.decode.address == "10.0.0.1:9000"
    assert r.registry.get("prefill", "10.0.0.2:7000") is placement.prefill


def test_no_header_a_failed_or_a_down_prefill_worker_leaves_the_prefill_to_the_decode_worker():
    r = router()
    assert r.route([1, 2, 3], prefill_at=NamedPrefill()).prefill is None
    assert r.route([1, 2, 3], prefill_at=NamedPrefill("10.0.0.2:7000")).prefill is not None
    assert r.route([1, 2, 3], prefill_at=NamedPrefill("10.0.0.2:7000"), exclude_prefill={"10.0.0.2:7000"}).prefill is None
    r.registry.get("prefill", "10.0.0.2:7000").state = InstanceState.UNHEALTHY
    assert r.route([1, 2, 3], prefill_at=NamedPrefill("10.0.0.2:7000")).prefill is None


def test_the_pull_the_picker_named_goes_with_the_named_prefill_worker_only():
    r = router()
    placement = r.route([1, 2, 3], prefill_at=NamedPrefill("10.0.0.2:7000", "10.0.0.4:7000", 32))
    assert (placement.pull_from, placement.pull_tokens) == ("10.0.0.4:7000", 32)
    local = r.route([1, 2, 3], prefill_at=NamedPrefill("10.0.0.2:7000", "10.0.0.4:7000", 32),
                    exclude_prefill={"10.0.0.2:7000"})
    assert local.prefill is None and local.pull_from == ""


@pytest.mark.parametrize("headers,param", [
    ({"x-prefiller-host-port": "nowhere"}, "x-prefiller-host-port"),
    ({"x-prefiller-host-port": "10.0.0.2:7000", "x-pdserve-kv-pull": "10.0.0.4:7000"}, "x-pdserve-kv-pull"),
    ({"x-prefiller-host-port": "10.0.0.2:7000", "x-pdserve-kv-pull": "peer 32"}, "x-pdserve-kv-pull"),
])
def test_a_bad_placement_header_is_a_400_naming_it(headers, param):
    with pytest.raises(ApiError) as refused:
        named_prefill(headers)
    assert refused.value.status == 400 and refused.value.param == param


def test_placement_headers_read_as_the_picker_wrote_them():
    assert named_prefill({}) == NamedPrefill()
    assert named_prefill({"x-pdserve-kv-pull": "10.0.0.4:7000 32"}) == NamedPrefill()  # no prefill worker: no pull
    assert named_prefill({"x-prefiller-host-port": "10.0.0.2:7000", "x-pdserve-kv-pull": "10.0.0.4:7000 32"}) == \
        NamedPrefill("10.0.0.2:7000", "10.0.0.4:7000", 32)


def test_prompt_logprobs_without_a_named_prefill_worker_are_refused_naming_the_header():
    with pytest.raises(WorkerError, match="x-prefiller-host-port"):
        router().route([1, 2, 3], prefill_at=NamedPrefill(), local_prefill=False)


def test_a_lost_decode_worker_has_no_replacement_in_a_sidecar():
    with pytest.raises(WorkerError, match="no healthy decode instance left"):
        router().route([1, 2, 3], prefill_at=NamedPrefill(), exclude_decode={"10.0.0.1:9000"})


def test_sidecar_settings_front_one_decode_worker_without_picker_planner_or_etcd():
    cluster = parse_config({"instances": {"decode": [{"address": "10.0.0.1:9000"}, {"address": "10.0.0.3:9000"}],
                                          "prefill": [{"address": "10.0.0.2:7000"}]},
                            "gateway_config": {"epp_port": 9002},
                            "digs_scheduler_config": {"algorithm_type": "cache_affinity"}})
    sidecar = sidecar_settings(cluster, "10.0.0.3:9000", 8000, announce_to="http://epp:1026")
    assert [i.address for i in sidecar.instances.decode] == ["10.0.0.3:9000"] and not sidecar.instances.prefill
    assert sidecar.http_config.predict_port == 8000 and not sidecar.gateway_config.enabled
    assert sidecar.digs_scheduler_config.algorithm_type == "round_robin"
    assert sidecar.sidecar_config.advertise == "127.0.0.1:8000"
    assert sidecar.sidecar_config.announce_to == "http://epp:1026"


def test_a_vllm_sidecar_must_front_a_listed_decode_instance():
    cluster = parse_config({"instances": {"decode": [{"engine": "vllm", "url": "http://10.0.0.1:8100"}]}})
    assert sidecar_settings(cluster, "10.0.0.1:8100", 8000).instances.decode[0].url == "http://10.0.0.1:8100"
    with pytest.raises(ConfigError, match="must be listed in instances.decode"):
        sidecar_settings(cluster, "10.0.0.9:8100", 8000)


def test_a_sidecar_on_port_0_must_say_where_it_is_reached():
    with pytest.raises(ConfigError, match="--advertise"):
        sidecar_settings(parse_config({}), "10.0.0.1:9000", 0)
    sidecar = sidecar_settings(parse_config({}), "10.0.0.1:9000", 0, advertise="10.0.0.1:8000")
    assert sidecar.http_config.predict_port == 0
