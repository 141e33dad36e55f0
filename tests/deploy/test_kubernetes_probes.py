"""Every container in deploy/kubernetes has readiness and liveness probes, and each asks what the container really
serves: workers grpc.health.v1 on the port that answers it without TLS, etcd endpoints its image version has."""

from __future__ import annotations

import json
import re

import pytest

from tests.deploy.test_kubernetes_manifests import OBJECTS, object_id
from worker.service.standard_health import service_names

WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
ETCD_PROBE_ENDPOINTS_SINCE = (3, 5, 11)  # /livez and /readyz; before that etcd has /health only


def containers() -> list[tuple[str, dict, dict]]:
    """(id, container, its manifest file's ConfigMaps' data merged) for every container of every workload."""
    found = []
    for path, doc in OBJECTS:
        if doc["kind"] in WORKLOAD_KINDS:
            config = {k: v for p, d in OBJECTS if p == path and d["kind"] == "ConfigMap" for k, v in d["data"].items()}
            for container in doc["spec"]["template"]["spec"]["containers"]:
                found.append((f"{object_id(path, doc)}/{container['name']}", container, config))
    return found


CONTAINERS = containers()
IDS = [c[0] for c in CONTAINERS]
WORKERS = [c for c in CONTAINERS if c[1].get("args", [None])[0] == "worker"]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def probe_port(container: dict, probe: dict) -> int:
    """The probe's port as a number (a named port is looked up in the container's ports)."""
    port = probe["port"]
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container.get("ports", []) if p.get("name") == port)


def test_the_manifests_have_a_prefill_a_decode_and_an_encode_worker():
    assert sorted(flag(c["args"], "--role") for _, c, _ in WORKERS) == ["decode", "encode", "prefill"]


@pytest.mark.parametrize(("name", "container", "config"), CONTAINERS, ids=IDS)
def test_every_container_has_readiness_and_liveness_probes(name, container, config):
    missing = [probe for probe in ("readinessProbe", "livenessProbe") if probe not in container]
    assert not missing, f"{name} has no {' and no '.join(missing)}"


@pytest.mark.parametrize(("name", "container", "config"), WORKERS, ids=[w[0] for w in WORKERS])
def test_worker_probes_ask_grpc_health_on_the_port_it_serves_it_on_without_tls(name, container, config):
    args = container["args"]
    grpc_port, health_port = int(flag(args, "--port")), flag(args, "--health-port")
    security_file = flag(args, "--security-config")
    security = json.loads(config[security_file.rsplit("/", 1)[-1]]) if security_file else {}
    grpc_has_tls = security.get("tls_config", {}).get("worker_grpc", {}).get("tls_enable", False)
    # Kubernetes' gRPC probes speak no TLS: with TLS on the gRPC port only --health-port can answer them.
    health_ports = {int(health_port)} if health_port else set()
    answering = (health_ports if grpc_has_tls else {grpc_port} | health_ports) - {0, -1}  # 0: a port nobody knows
    assert answering, f"{name}: TLS on worker gRPC and no --health-port for the probes"
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if kind not in container:
            continue
        probe = container[kind].get("grpc")
        assert probe is not None, f"{name} {kind} is not a gRPC probe: {container[kind]}"
        assert probe_port(container, probe) in answering, f"{name} {kind} asks port {probe['port']}, not {answering}"
        assert probe.get("service", "") in service_names(flag(args, "--role")), f"{name} {kind}: {probe}"


def test_etcd_probes_use_endpoints_its_image_has():
    etcd = [(n, c) for n, c, _ in CONTAINERS if c.get("command") == ["etcd"]]
    assert etcd, "no etcd container in the manifests"
    for name, container in etcd:
        version = tuple(int(part) for part in re.search(r":v(\d+)\.(\d+)\.(\d+)", container["image"]).groups())
        for kind in ("readinessProbe", "livenessProbe"):
            path = container[kind]["httpGet"]["path"].split("?")[0]
            assert path in ("/health", "/livez", "/readyz"), f"{name} {kind}: {path} is not an etcd health endpoint"
            if path != "/health":
                assert version >= ETCD_PROBE_ENDPOINTS_SINCE, f"{name}: etcd {version} has no {path}"
