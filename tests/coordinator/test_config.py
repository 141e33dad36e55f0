"""ms_coordinator.json: defaults, overrides, and start-up failures that name the key."""

from __future__ import annotations

import json
import subprocess

import aiohttp
import pytest

from coordinator.config import ConfigError, load_config, parse_config
from tests.helpers import REPO, pdserve_argv

MINIMAL = {"instances": {"prefill": [{"address": "127.0.0.1:50051"}], "decode": [{"address": "127.0.0.1:50052"}]}}


def test_shipped_config_is_valid():
    config = load_config(REPO / "ms_coordinator.json")
    assert config.http_config.predict_port == 1025
    assert config.model_settings.maxIterTimes == 512
    assert not config.speculative_config.enabled


def test_minimal_config_gets_defaults():
    config = parse_config(MINIMAL)
    assert config.http_config.predict_ip == "127.0.0.1"
    assert config.digs_scheduler_config.algorithm_type == "round_robin"


async def test_the_default_keep_alive_outlasts_an_aiohttp_clients_idle_pool():
    # A server that closes an idle connection no later than the client drops it from its pool races the client's
    # next request on it (lost with "Server disconnected"): aiohttp's client keeps idle connections 15 s, and a
    # loaded client may read a response's end long after it was sent.
    connector = aiohttp.TCPConnector()
    try:
        assert parse_config({}).http_config.keepalive_timeout_s > 2 * connector._keepalive_timeout
    finally:
        await connector.close()


def test_numeric_string_port_is_accepted_as_mindie_writes_it():
    config = parse_config({**MINIMAL, "http_config": {"predict_port": "1025"}})
    assert config.http_config.predict_port == 1025


def test_instances_may_be_left_to_registration():
    config = parse_config({})
    assert config.instances.prefill == [] and config.instances.decode == []
    assert config.digs_scheduler_config.local_prefill_max_tokens == 0  # conditional disaggregation is off


@pytest.mark.parametrize("policy", ["round_robin", "load_balance", "cache_affinity"])
def test_every_routing_policy_is_accepted(policy):
    assert parse_config({**MINIMAL, "digs_scheduler_config": {"algorithm_type": policy}}).digs_scheduler_config.algorithm_type == policy


@pytest.mark.parametrize("data,needle", [
    ({**MINIMAL, "http_config": {"predict_prot": 1}}, "http_config.predict_prot: unknown key"),
    ({**MINIMAL, "http_config": {"predict_port": "abc"}}, "http_config.predict_port"),
    ({**MINIMAL, "http_config": {"predict_port": 70000}}, "http_config.predict_port"),
    ({**MINIMAL, "model_config": {"maxIterTimes": 0}}, "model_config.maxIterTimes"),
    ({**MINIMAL, "model_config": {"fullTextEnabled": "maybe"}}, "model_config.fullTextEnabled"),
    ({**MINIMAL, "digs_scheduler_config": {"algorithm_type": "random"}}, "digs_scheduler_config.algorithm_type"),
    ({"instances": {"prefill": [{"address": "nohost"}], "decode": [{"address": "h:1"}]}}, "instances.prefill.0.address"),
    ({**MINIMAL, "health_config": {"failure_threshold": 0}}, "health_config.failure_threshold"),
    ({**MINIMAL, "request_limit": {"max_running": 0}}, "request_limit.max_running"),
    ({**MINIMAL, "backup_config": {"etcd_endpoints": ["http://127.0.0.1:2379"], "mode": "replicas",
                                   "lease_ttl_s": 2, "sync_interval_s": 1.5}}, "sync_interval_s (1.5) must be at most"),
    ({**MINIMAL, "tenancy_config": {"objectives": {"gold": 7}}}, "tenancy_config.objectives"),
    ({**MINIMAL, "tenancy_config": {"burst_s": 0}}, "tenancy_config.burst_s"),
    ({**MINIMAL, "digs_scheduler_config": {"local_prefill_max_tokens": -1}},
     "digs_scheduler_config.local_prefill_max_tokens"),
    ({**MINIMAL, "surprise": True}, "surprise: unknown key"),
    ({"instances": {"decode": [{"address": "h:1", "speculative": "ngram"}]}},
     "url, kv_events, device and speculative are for engine vllm"),
    ({"instances": {"decode": [{"engine": "vllm", "url": "http://h:1", "speculative": "eagle"}]}},
     "instances.decode.0.speculative"),
    ({**MINIMAL, "digs_scheduler_config": {"cache_affinity_decode_load_weight": -1}},
     "digs_scheduler_config.cache_affinity_decode_load_weight"),
    ({**MINIMAL, "digs_scheduler_config": {"cache_affinity_block_tokens": 16}},
     "cache_affinity_block_tokens was removed: the block size is each worker's own (--block-size)"),
    ({**MINIMAL, "digs_scheduler_config": {"cache_affinity_max_load_ratio": 2}},
     "cache_affinity_max_load_ratio was removed: cache_affinity weighs load against cached tokens"),
])
def test_invalid_config_error_names_the_key(data, needle):
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert needle in str(err.value)


@pytest.mark.system
def test_coordinator_refuses_to_start_with_a_bad_config(tmp_path):
    path = tmp_path / "ms_coordinator.json"
    path.write_text(json.dumps({**MINIMAL, "http_config": {"predict_prot": 1}}))
    proc = subprocess.run(pdserve_argv("coordinator", "--config", str(path)), cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "http_config.predict_prot: unknown key" in proc.stderr


@pytest.mark.system
def test_coordinator_refuses_a_file_that_is_not_json(tmp_path):
    path = tmp_path / "ms_coordinator.json"
    path.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(path)


def test_the_model_is_served_under_its_folder_name():
    config = parse_config({"model_config": {"modelWeightPath": "/models/Llama-3.2-1B-Instruct/"}})
    assert config.model_settings.modelName == "Llama-3.2-1B-Instruct"


def test_the_embedded_model_is_served_as_pdserve_tiny():
    assert parse_config({}).model_settings.modelName == "pdserve-tiny"
    assert parse_config({"model_config": {"modelName": ""}}).model_settings.modelName == "pdserve-tiny"


def test_an_explicit_model_name_wins_over_the_folder():
    config = parse_config({"model_config": {"modelName": "chat", "modelWeightPath": "/models/llama"}})
    assert config.model_settings.modelName == "chat"
    assert config.model_dump(by_alias=True)["model_config"]["modelName"] == "chat"


def test_a_folder_name_follows_a_new_weight_path_through_a_dump():
    # `pdserve up --config F --model DIR` dumps F's config and sets DIR: the name must be DIR's.
    data = parse_config({"model_config": {"modelWeightPath": "/models/old"}}).model_dump(by_alias=True)
    data["model_config"]["modelWeightPath"] = "/models/new"
    assert parse_config(data).model_settings.modelName == "new"


def test_the_coordinator_answers_as_its_model_folder(model_dir, tmp_path):
    from coordinator.http.app import create_app
    from coordinator.state import STATE

    (tmp_path / "my-model").symlink_to(model_dir, target_is_directory=True)
    app = create_app(parse_config({"model_config": {"modelWeightPath": str(tmp_path / "my-model")}}))
    assert app[STATE].model_name == "my-model"


def test_without_backup_config_there_is_no_etcd():
    backup = parse_config({}).backup_config
    assert backup.etcd_endpoints == [] and backup.mode == "active_standby"
    assert (backup.key_prefix, backup.lease_ttl_s, backup.sync_interval_s, backup.etcd_timeout_s) == ("/pdserve", 3, 1, 1)
    assert backup.coordinator_name == ""


def test_backup_config_takes_exactly_the_documented_keys():
    section = {"etcd_endpoints": ["http://127.0.0.1:2379"], "key_prefix": "/pdserve/", "mode": "replicas",
               "lease_ttl_s": 3, "sync_interval_s": 1, "etcd_timeout_s": 1, "coordinator_name": "east-1"}
    backup = parse_config({"backup_config": section}).backup_config
    assert set(type(backup).model_fields) == set(section)
    assert backup.key_prefix == "/pdserve" and backup.mode == "replicas"


@pytest.mark.parametrize("section,needle", [
    ({"etcd_endpoints": ["127.0.0.1:2379"]}, "backup_config.etcd_endpoints"),
    ({"etcd_endpoints": ["http://127.0.0.1"]}, "backup_config.etcd_endpoints"),
    ({"key_prefix": "pdserve"}, "backup_config.key_prefix"),
    ({"mode": "primary"}, "backup_config.mode"),
    ({"lease_ttl_s": 0}, "backup_config.lease_ttl_s"),
    ({"sync_interval_s": 0}, "backup_config.sync_interval_s"),
    ({"etcd_endpoint": []}, "backup_config.etcd_endpoint: unknown key"),
    ({"etcd_endpoints": ["https://etcd:2379"]}, "set tls_config.etcd"),
])
def test_invalid_backup_config_names_the_key(section, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_config({"backup_config": section})


def test_https_etcd_endpoints_take_tls_config_etcd():
    config = parse_config({"backup_config": {"etcd_endpoints": ["https://etcd:2379"]},
                           "tls_config": {"etcd": {"tls_enable": True, "ca_cert": "ca.pem"}}})
    assert config.tls_config.etcd.ca_cert == "ca.pem"
    with pytest.raises(ConfigError, match="plain http"):
        parse_config({"backup_config": {"etcd_endpoints": ["http://etcd:2379"]},
                      "tls_config": {"etcd": {"tls_enable": True}}})


VLLM = {"instances": {"prefill": [{"engine": "vllm", "url": "http://127.0.0.1:8100/", "kv_events": "ipc:///tmp/p"}],
                      "decode": [{"engine": "vllm", "url": "http://127.0.0.1:8200"}]}}


def test_a_vllm_instance_is_named_by_its_urls_host_and_port():
    config = parse_config(VLLM)
    assert config.instances.engine == "vllm"
    assert config.instances.urls() == {"127.0.0.1:8100": "http://127.0.0.1:8100", "127.0.0.1:8200": "http://127.0.0.1:8200"}
    assert config.instances.kv_event_endpoints() == {"127.0.0.1:8100": "ipc:///tmp/p"}
    assert [i.address for i in config.instances.prefill] == ["127.0.0.1:8100"]
    assert config.instances.seeded_sampling()


def test_a_fleet_with_a_cpu_vllm_instance_does_not_sample_from_seeds():
    cpu = {"instances": {**VLLM["instances"], "decode": [{"engine": "vllm", "url": "http://127.0.0.1:8200",
                                                           "device": "cpu"}]}}
    assert not parse_config(cpu).instances.seeded_sampling()


@pytest.mark.parametrize("instances, message", [
    ({"prefill": [{"engine": "vllm", "url": "http://127.0.0.1:8100"}], "decode": [{"address": "127.0.0.1:9"}]},
     "same engine"),
    ({"decode": [{"engine": "vllm", "url": "127.0.0.1:8100"}]}, "decode.0.url"),
    ({"decode": [{"engine": "vllm", "url": "http://127.0.0.1:8100", "address": "127.0.0.1:1"}]}, "differs"),
    ({"decode": [{"engine": "vllm", "url": "http://127.0.0.1:8100", "kv_events": "udp://x:1"}]}, "kv_events"),
    ({"decode": [{"address": "127.0.0.1:9", "url": "http://127.0.0.1:8100"}]}, "for engine vllm"),
    ({"decode": [{"address": "127.0.0.1:9", "device": "cpu"}]}, "for engine vllm"),
    ({"decode": [{"engine": "vllm", "url": "http://127.0.0.1:8100", "device": "tpu"}]}, "decode.0.device"),
    ({"decode": [{"engine": "vllm", "url": "https://127.0.0.1:8100"}]}, "tls_config.worker_grpc"),
])
def test_vllm_instance_mistakes_fail_start_up_naming_the_key(instances, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"instances": instances})


@pytest.mark.parametrize("section,needle", [
    ({"tpot_ms": 0}, "planner_config.tpot_ms"),
    ({"percentile": 101}, "planner_config.percentile"),
    ({"max_instances": 3, "min_per_role": 2}, "min_per_role"),
    ({"window": 30}, "planner_config.window: unknown key"),
])
def test_invalid_planner_config_names_the_key(section, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_config({"planner_config": section})


def test_the_planner_is_refused_beside_replica_coordinators_and_reads_profiles_beside_its_config(tmp_path):
    replicas = {"backup_config": {"etcd_endpoints": ["http://127.0.0.1:2379"], "mode": "replicas"},
                "planner_config": {"enabled": True}}
    with pytest.raises(ConfigError, match="planner_config.enabled needs backup_config.mode active_standby"):
        parse_config(replicas)
    path = tmp_path / "ms_coordinator.json"
    path.write_text(json.dumps({"planner_config": {"enabled": True, "decode_profile": "profiles/decode.json"}}))
    assert load_config(path).planner_config.decode_profile == str(tmp_path / "profiles" / "decode.json")


def test_a_missing_planner_profile_fails_start_up_naming_it(tmp_path):
    from coordinator.http.app import create_app

    path = tmp_path / "ms_coordinator.json"
    path.write_text(json.dumps({"planner_config": {"enabled": True, "prefill_profile": "nowhere.json"}}))
    with pytest.raises(ConfigError, match="planner_config: .*nowhere.json: cannot read"):
        create_app(load_config(path))


def test_the_planner_is_refused_on_a_vllm_fleet_naming_why():
    with pytest.raises(ConfigError, match="vLLM instances do not report"):
        parse_config({**VLLM, "planner_config": {"enabled": True}})
