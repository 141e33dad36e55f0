"""The shipped deployment files stay consistent with the code that reads them."""

from __future__ import annotations

import json

import yaml

from coordinator.config import load_config, parse_config
from tests.helpers import REPO


def test_local_deploy_config_is_valid():
    load_config(REPO / "deploy" / "local" / "ms_coordinator.json")


def test_kubernetes_workers_register_with_the_coordinators_management_service():
    docs = list(yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "pdserve.yaml").read_text()))
    configmap = next(d for d in docs if d["kind"] == "ConfigMap")
    config = parse_config(json.loads(configmap["data"]["ms_coordinator.json"]))
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    ports = {p["containerPort"] for d in docs if d["kind"] == "Deployment"
             for c in d["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    assert {config.http_config.predict_port, config.http_config.manage_port} <= ports
    from launcher.cli import build_parser

    for sts in (d for d in docs if d["kind"] == "StatefulSet"):
        pod = sts["spec"]["template"]["spec"]
        args = build_parser().parse_args(pod["containers"][0]["args"])
        host, port = args.coordinator.removeprefix("http://").split(":")
        assert host in services and int(port) == config.http_config.manage_port
        assert args.advertise_host == "$(POD_IP)"  # 0.0.0.0 is not an address others can dial
        assert pod["terminationGracePeriodSeconds"] > args.drain_seconds
