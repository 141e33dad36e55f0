"""deploy/prometheus/prometheus.yml scrapes what pdserve really serves: the local coordinators on their shipped
ports, and each annotated Kubernetes pod at the port and scheme it serves /metrics on (the job's relabelling
applied here to the manifests' pods, as Prometheus would). Structural: promtool is not installed by the CI."""

from __future__ import annotations

import re

import yaml

from coordinator.config import load_config, parse_config
from launcher.local_cluster import ClusterOptions, _cluster_config
from tests.deploy.test_deploy_files import (LOCAL, coordinator_config, kubernetes_docs, of_kind, pdserve_args,
                                            selects)
from tests.helpers import REPO

PROMETHEUS = REPO / "deploy" / "prometheus" / "prometheus.yml"
POD_IP = "10.0.0.7"


def scrape_configs() -> dict[str, dict]:
    jobs = yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]
    return {job["job_name"]: job for job in jobs}


def local_coordinator_configs() -> dict[str, dict]:
    """Each way of running coordinators on this machine -> its http_config: the deploy/local configs (the
    scripts' coordinators) and `pdserve up` without --config (the launcher's defaults)."""

    class NoSecurity:
        def coordinator_sections(self) -> dict:
            return {}

    configs = {path.name: load_config(path) for path in sorted(LOCAL.glob("*.json"))}
    configs["pdserve up"] = parse_config(_cluster_config(ClusterOptions(), [], [], "", NoSecurity()))
    return {name: config.http_config for name, config in configs.items()}


def sanitize(name: str) -> str:
    """A Kubernetes label or annotation name as Prometheus's service discovery writes it into a label name."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def relabel(labels: dict[str, str], configs: list[dict]) -> dict[str, str] | None:
    """Prometheus's relabelling for the actions prometheus.yml uses; None when the target is dropped."""
    labels = dict(labels)
    for config in configs:
        action = config.get("action", "replace")
        value = config.get("separator", ";").join(labels.get(s, "") for s in config.get("source_labels", []))
        match = re.fullmatch(config.get("regex", "(.*)"), value)
        if action == "keep":
            if not match:
                return None
        elif action == "drop":
            if match:
                return None
        elif action == "replace":
            if match:
                result = re.sub(r"\$\{?(\d+)\}?", lambda m: match.group(int(m.group(1))) or "",
                                config.get("replacement", "$1"))
                if result:
                    labels[config["target_label"]] = result
                else:
                    labels.pop(config["target_label"], None)
        else:
            raise AssertionError(f"relabel action {action} is not modelled here: add it")
    return labels


def pod_targets(workload: dict) -> list[dict[str, str]]:
    """What pod service discovery offers for one pod of a workload: a target per declared container port."""
    pod = workload["spec"]["template"]
    meta = {"__meta_kubernetes_namespace": "default", "__meta_kubernetes_pod_name": f"{workload['metadata']['name']}-0",
            **{f"__meta_kubernetes_pod_label_{sanitize(k)}": v for k, v in pod["metadata"].get("labels", {}).items()},
            **{f"__meta_kubernetes_pod_annotation_{sanitize(k)}": v
               for k, v in pod["metadata"].get("annotations", {}).items()}}
    ports = [p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])]
    return [{**meta, "__address__": f"{POD_IP}:{port}"} for port in ports] or [{**meta, "__address__": POD_IP}]


def served_metrics(docs: list[dict], workload: dict) -> tuple[str, int] | None:
    """(scheme, port) a pdserve pod serves /metrics on, from its own config or command line."""
    container = workload["spec"]["template"]["spec"]["containers"][0]
    role = workload["spec"]["template"]["metadata"]["labels"].get("role")
    if role == "coordinator":
        config = coordinator_config(docs)
        tls = config.tls_config.management.tls_enable
        return ("https" if tls else "http"), config.http_config.manage_port
    if role in ("prefill", "decode", "encode"):
        port = pdserve_args(container).metrics_port
        return ("http", port) if port > 0 else None  # 0: a port picked at start, -1: no metrics
    return None


def test_prometheus_config_parses_with_unique_job_names():
    jobs = yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]
    names = [job["job_name"] for job in jobs]
    assert len(names) == len(set(names)), names
    assert {"pdserve-local", "pdserve-kubernetes"} <= set(names)


def test_local_job_scrapes_every_local_coordinator_on_a_port_it_serves_metrics_on():
    coordinators = local_coordinator_configs()
    served = {port for http in coordinators.values() for port in (http.predict_port, http.manage_port)}
    targets = [t for group in scrape_configs()["pdserve-local"]["static_configs"] for t in group["targets"]]
    for target in targets:
        host, port = target.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) in served, f"{target}: no local coordinator serves metrics there"
    for name, http in coordinators.items():
        assert f"127.0.0.1:{http.manage_port}" in targets, f"{name}'s coordinator is not scraped"


def test_kubernetes_job_scrapes_each_pdserve_pod_where_it_serves_metrics():
    docs = kubernetes_docs()
    job = scrape_configs()["pdserve-kubernetes"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    workloads = [*of_kind(docs, "Deployment").values(), *of_kind(docs, "StatefulSet").values()]
    scraped = {}
    for workload in workloads:
        expected = served_metrics(docs, workload)
        results = [relabel(t, job["relabel_configs"]) for t in pod_targets(workload)]
        kept = {(r.get("__scheme__", job.get("scheme", "http")), r["__address__"],
                 r.get("__metrics_path__", job.get("metrics_path", "/metrics"))) for r in results if r is not None}
        name = workload["metadata"]["name"]
        if expected is None:
            assert not kept, f"{name} serves no metrics at a known port, yet is scraped"
            continue
        scheme, port = expected
        # One target however many ports the pod declares (Prometheus merges identical targets).
        assert kept == {(scheme, f"{POD_IP}:{port}", "/metrics")}, name
        scraped[name] = next(r for r in results if r is not None)
    assert set(scraped) == {"pdserve-coordinator", "pdserve-prefill", "pdserve-decode", "pdserve-encode"}
    assert scraped["pdserve-prefill"]["component"] == "prefill"
    assert scraped["pdserve-encode"]["component"] == "encode"


def test_kubernetes_job_reads_only_annotations_and_labels_the_manifests_set():
    pods = [w["spec"]["template"]["metadata"] for kind in ("Deployment", "StatefulSet")
            for w in of_kind(kubernetes_docs(), kind).values()]
    set_on_pods = {f"__meta_kubernetes_pod_{what}_{sanitize(k)}" for pod in pods
                   for what, field in (("annotation", "annotations"), ("label", "labels")) for k in pod.get(field, {})}
    read = {s for config in scrape_configs()["pdserve-kubernetes"]["relabel_configs"]
            for s in config.get("source_labels", []) if re.match(r"__meta_kubernetes_pod_(annotation|label)_", s)}
    assert read and read <= set_on_pods, f"read but set on no pod: {sorted(read - set_on_pods)}"


def test_kubernetes_job_checks_the_coordinators_certificate_against_the_management_service():
    docs = kubernetes_docs()
    tls = scrape_configs()["pdserve-kubernetes"]["tls_config"]
    service = of_kind(docs, "Service")[tls["server_name"]]
    coordinator = of_kind(docs, "Deployment")["pdserve-coordinator"]["spec"]["template"]
    assert selects(service["spec"]["selector"], coordinator["metadata"]["labels"])
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [coordinator_config(docs).http_config.manage_port]
