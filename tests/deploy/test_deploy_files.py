"""The shipped deployment files stay consistent with the code that reads them."""

from __future__ import annotations

import json

import yaml

from coordinator.config import load_config, parse_config
from tests.conftest import REPO


def test_local_deploy_config_is_valid():
    load_config(REPO / "deploy" / "local" / "ms_coordinator.json")


def test_kubernetes_configmap_holds_a_valid_config_naming_the_worker_services():
    docs = list(yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "pdserve.yaml").read_text()))
    configmap = next(d for d in docs if d["kind"] == "ConfigMap")
    config = parse_config(json.loads(configmap["data"]["ms_coordinator.json"]))
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    for instance in config.instances.prefill + config.instances.decode:
        host = instance.address.split(":")[0]
        assert host.split(".")[1] in services, f"{host} names no Service in the manifest"
    ports = {c["ports"][0]["containerPort"] for d in docs if d["kind"] == "Deployment"
             for c in d["spec"]["template"]["spec"]["containers"]}
    assert config.http_config.predict_port in ports
