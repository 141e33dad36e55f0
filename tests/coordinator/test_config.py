"""ms_coordinator.json: defaults, overrides, and start-up failures that name the key."""

from __future__ import annotations

import json
import subprocess

import pytest

from coordinator.config import ConfigError, load_config, parse_config
from tests.helpers import REPO, pdserve_argv

MINIMAL = {"instances": {"prefill": [{"address": "127.0.0.1:50051"}], "decode": [{"address": "127.0.0.1:50052"}]}}


def test_shipped_config_is_valid():
    config = load_config(REPO / "ms_coordinator.json")
    assert config.http_config.predict_port == 1025
    assert config.model_settings.maxIterTimes == 512


def test_minimal_config_gets_defaults():
    config = parse_config(MINIMAL)
    assert config.http_config.predict_ip == "127.0.0.1"
    assert config.digs_scheduler_config.algorithm_type == "round_robin"


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
    ({**MINIMAL, "digs_scheduler_config": {"local_prefill_max_tokens": -1}},
     "digs_scheduler_config.local_prefill_max_tokens"),
    ({**MINIMAL, "surprise": True}, "surprise: unknown key"),
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
