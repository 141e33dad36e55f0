"""The shipped deployment files stay consistent with the code that reads them."""

from __future__ import annotations

import argparse
import json
import shlex
import tomllib
from pathlib import Path

import yaml

from coordinator.config import CoordinatorConfig, load_config, parse_config
from launcher.cli import build_parser
from security.settings import load_security_file
from tests.helpers import REPO

LOCAL = REPO / "deploy" / "local"
KUBERNETES = REPO / "deploy" / "kubernetes"


def kubernetes_docs() -> list[dict]:
    """Every object of every manifest, the Secrets' template included; not gateway.yaml's, a cluster of its own
    (tests/deploy/test_kubernetes_gateway.py)."""
    return [doc for path in sorted(KUBERNETES.rglob("*.yaml")) if path != KUBERNETES / "gateway.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def of_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def coordinator_deployment(docs: list[dict]) -> dict:
    return of_kind(docs, "Deployment")["pdserve-coordinator"]


def worker_deployments(docs: list[dict]) -> list[dict]:
    """The prefill, decode and encode workers' Deployments: every Deployment but the coordinators'."""
    return [d for d in of_kind(docs, "Deployment").values()
            if d["spec"]["template"]["metadata"]["labels"]["role"] != "coordinator"]


def coordinator_config(docs: list[dict]) -> CoordinatorConfig:
    return parse_config(json.loads(of_kind(docs, "ConfigMap")["pdserve-coordinator"]["data"]["ms_coordinator.json"]))


def shell_line(container: dict) -> list[str] | None:
    """The words of a container's `sh -c` line, if it has one."""
    if container.get("command", [None])[0] != "/bin/sh":
        return None
    return shlex.split(container["args"][-1])


def pdserve_args(container: dict) -> argparse.Namespace:
    """The container's pdserve command line (the one its `sh -c` line execs, if any), parsed by the CLI."""
    words = shell_line(container)
    argv = container["args"] if words is None else words[words.index("pdserve") + 1:]
    return build_parser().parse_args(argv)


def mounted_files(docs: list[dict], pod: dict, container: dict) -> dict[str, tuple[str, str]]:
    """Each file a container sees from ConfigMaps and Secrets: its path -> (object name, key)."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    configmaps, secrets = of_kind(docs, "ConfigMap"), of_kind(docs, "Secret")
    files = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            source = volume["configMap"]
            keys = set(configmaps[source["name"]]["data"])
        elif "secret" in volume:
            source = volume["secret"]
            secret = secrets[source["secretName"]]
            keys = set(secret.get("data", {})) | set(secret.get("stringData", {}))
            source = {**source, "name": source["secretName"]}
        else:
            continue
        items = source.get("items") or [{"key": k, "path": k} for k in keys]
        for item in items:
            assert item["key"] in keys, f"volume {mount['name']} names {item['key']}, which {source['name']} lacks"
            files[f"{mount['mountPath']}/{item['path']}"] = (source["name"], item["key"])
    return files


def test_local_deploy_configs_are_valid():
    load_config(LOCAL / "ms_coordinator.json")
    a, b = (load_config(LOCAL / f"ha_coordinator_{name}.json") for name in "ab")
    for config in (a, b):
        assert config.backup_config.etcd_endpoints == ["http://127.0.0.1:2379"]  # the script's etcd
        assert config.backup_config.mode == "active_standby"
    assert a.backup_config.key_prefix == b.backup_config.key_prefix  # one cluster
    assert a.backup_config.coordinator_name != b.backup_config.coordinator_name
    ports = [a.http_config.predict_port, a.http_config.manage_port, b.http_config.predict_port,
             b.http_config.manage_port]
    assert len(set(ports)) == 4


def test_kubernetes_coordinators_share_the_cluster_through_the_etcd_service():
    docs = kubernetes_docs()
    services, etcd = of_kind(docs, "Service"), of_kind(docs, "StatefulSet")["pdserve-etcd"]
    for configmap in of_kind(docs, "ConfigMap").values():
        for key, text in configmap["data"].items():
            if "backup_config" not in json.loads(text):
                continue
            config = parse_config(json.loads(text), key)
            assert config.backup_config.mode == "replicas"  # the useful default behind a Service
            for url in config.backup_config.etcd_endpoints:
                host, port = url.removeprefix("http://").split(":")
                service = services[host]
                assert selects(service["spec"]["selector"], etcd["spec"]["template"]["metadata"]["labels"])
                assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    etcd_args = etcd["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "http://0.0.0.0:2379" in etcd_args
    # Each replica writes its own pod name over the placeholder, so their names in etcd differ.
    config = coordinator_config(docs)
    assert config.backup_config.coordinator_name == "@POD_NAME@"
    container = coordinator_deployment(docs)["spec"]["template"]["spec"]["containers"][0]
    words = shell_line(container)
    assert words[:2] == ["sed", "s/@POD_NAME@/$POD_NAME/"]
    assert words[words.index(">") + 1] == pdserve_args(container).config
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]


def test_kubernetes_coordinator_probes_and_services_match_what_it_serves():
    from coordinator.http.management import MANAGEMENT_ROUTES

    docs = kubernetes_docs()
    config = coordinator_config(docs)
    deployment = coordinator_deployment(docs)
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    http = config.http_config
    assert {p["containerPort"] for p in container["ports"]} == {http.predict_port, http.manage_port}
    scheme = "HTTPS" if config.tls_config.management.tls_enable else "HTTP"
    for probe, path in (("readinessProbe", "/health"), ("livenessProbe", "/health/live")):
        get = container[probe]["httpGet"]
        assert (get["path"], get["port"], get["scheme"]) == (path, http.manage_port, scheme)
        assert MANAGEMENT_ROUTES.find("GET", path) is not None
    assert pod["spec"]["terminationGracePeriodSeconds"] > http.drain_seconds
    services = of_kind(docs, "Service")
    for name, port in (("pdserve", http.predict_port), ("pdserve-manage", http.manage_port)):
        assert selects(services[name]["spec"]["selector"], pod["metadata"]["labels"])
        assert [p["targetPort"] for p in services[name]["spec"]["ports"]] == [port]
    assert services["pdserve"]["spec"]["sessionAffinity"] == "ClientIP"
    # Workers register with coordinators that are not Ready yet (no workers, or a standby).
    assert services["pdserve-manage"]["spec"]["publishNotReadyAddresses"] is True


def test_kubernetes_disruption_budget_covers_the_coordinators_only():
    docs = kubernetes_docs()
    (pdb,) = of_kind(docs, "PodDisruptionBudget").values()
    assert pdb["spec"]["minAvailable"] == 1
    selector = pdb["spec"]["selector"]["matchLabels"]
    deployment = coordinator_deployment(docs)
    assert selects(selector, deployment["spec"]["template"]["metadata"]["labels"])
    assert pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]
    for workload in [*worker_deployments(docs), *of_kind(docs, "StatefulSet").values()]:
        assert not selects(selector, workload["spec"]["template"]["metadata"]["labels"])


def test_kubernetes_secrets_hold_every_file_the_configs_name():
    docs = kubernetes_docs()
    deployment = coordinator_deployment(docs)["spec"]["template"]["spec"]
    coordinator = deployment["containers"][0]
    files = mounted_files(docs, deployment, coordinator)
    source = shell_line(coordinator)[2]
    assert files[source] == ("pdserve-coordinator", "ms_coordinator.json")
    config = coordinator_config(docs)
    named = [getattr(link, key) for link in (config.tls_config.predict, config.tls_config.management)
             for key in ("tls_cert", "tls_key")]
    named += [config.auth_config.api_keys_file, config.auth_config.registration_token_file,
              config.auth_config.worker_secret_file]
    assert config.tls_config.predict.tls_enable and config.auth_config.api_keys_file
    for path in named:
        assert path in files and files[path][0] in of_kind(docs, "Secret"), f"{path} is not from a mounted Secret"
    for workload in [*worker_deployments(docs), *of_kind(docs, "StatefulSet").values()]:
        pod = workload["spec"]["template"]["spec"]
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["secretName"] in of_kind(docs, "Secret")


def test_kubernetes_workers_register_with_the_coordinators_management_service(tmp_path: Path):
    docs = kubernetes_docs()
    config = coordinator_config(docs)
    services = of_kind(docs, "Service")
    workers = worker_deployments(docs)
    # Encode workers too: the coordinator config's instances cannot list them, so registering is their only way in.
    assert sorted(w["spec"]["template"]["metadata"]["labels"]["role"] for w in workers) == ["decode", "encode",
                                                                                          "prefill"]
    # A StatefulSet is etcd's alone: a worker needs no stable name (it registers its pod IP), and a StatefulSet
    # could not surge during an upgrade (tests/deploy/test_kubernetes_rollouts.py).
    assert set(of_kind(docs, "StatefulSet")) == {"pdserve-etcd"}
    for workload in workers:
        pod = workload["spec"]["template"]["spec"]
        container = pod["containers"][0]
        args = pdserve_args(container)
        assert args.role == workload["spec"]["template"]["metadata"]["labels"]["role"]
        scheme, _, host_port = args.coordinator.partition("://")
        host, port = host_port.split(":")
        assert host in services and int(port) == config.http_config.manage_port
        assert scheme == ("https" if config.tls_config.management.tls_enable else "http")
        assert args.advertise_host == "$(POD_IP)"  # 0.0.0.0 is not an address others can dial
        assert pod["terminationGracePeriodSeconds"] > args.drain_seconds
        assert {p["containerPort"] for p in container["ports"]} == {args.port}

        files = mounted_files(docs, pod, container)
        name, key = files[args.security_config]
        copy = tmp_path / key
        copy.write_text(of_kind(docs, "ConfigMap")[name]["data"][key])
        security = load_security_file(str(copy))
        registration, auth = security.tls_config.registration, security.auth_config
        assert registration.tls_enable == (scheme == "https")
        for path in (registration.ca_cert, auth.registration_token_file, auth.worker_secret_file):
            assert path in files, f"{path} is not mounted in {workload['metadata']['name']}"
        # The same token and secret as the coordinators'.
        coordinator_files = mounted_files(docs, coordinator_deployment(docs)["spec"]["template"]["spec"],
                                          coordinator_deployment(docs)["spec"]["template"]["spec"]["containers"][0])
        assert files[auth.registration_token_file] == coordinator_files[config.auth_config.registration_token_file]
        assert files[auth.worker_secret_file] == coordinator_files[config.auth_config.worker_secret_file]
        assert files[registration.ca_cert] == ("pdserve-tls", "ca.pem")
        assert "server-key.pem" not in {key for _, key in files.values()}  # workers never hold its key


def image_models() -> dict[str, bool]:
    """Each model folder the Dockerfile builds into the image -> whether it is a vision-language one (--vlm)."""
    text = (REPO / "deploy" / "Dockerfile").read_text().replace("\\\n", " ")
    models = {}
    for line in text.splitlines():
        for command in line.split("&&") if not line.lstrip().startswith("#") else ():
            words = shlex.split(command)
            if "build-model" in words:
                args = build_parser().parse_args(words[words.index("pdserve") + 1:])
                models[args.out] = args.vlm
    return models


def test_kubernetes_encode_workers_run_the_vision_encoder_of_the_other_workers_model():
    docs = kubernetes_docs()
    workers = {d["spec"]["template"]["metadata"]["labels"]["role"]: d for d in worker_deployments(docs)}
    args = {role: pdserve_args(d["spec"]["template"]["spec"]["containers"][0]) for role, d in workers.items()}
    encode = args["encode"]
    assert encode.role == "encode"
    # One checkpoint for the cluster: the prefill workers build prompts around the encode workers' outputs.
    assert encode.model == args["prefill"].model == args["decode"].model
    assert encode.model == coordinator_config(docs).model_settings.modelWeightPath
    assert encode.encoder_cache_images is None or encode.encoder_cache_images > 0  # 0 would turn its cache off
    assert encode.max_encode_batch_images >= 1
    assert not encode.simulate  # a simulated worker refuses --role encode


def test_kubernetes_encode_workers_start_scaled_to_zero_while_their_model_is_the_images_text_model():
    # An encode worker refuses a checkpoint without a vision tower: on the image's text model a replica would only
    # crash-loop. It is scaled up once the cluster's model is a vision-language one.
    docs = kubernetes_docs()
    (encode,) = [d for d in worker_deployments(docs) if d["spec"]["template"]["metadata"]["labels"]["role"] == "encode"]
    model = pdserve_args(encode["spec"]["template"]["spec"]["containers"][0]).model
    models = image_models()
    assert models, "the Dockerfile builds no model"
    if model in models and not models[model]:
        assert encode["spec"]["replicas"] == 0


def test_dockerfile_copies_every_package():
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = {line.split()[1] for line in (REPO / "deploy" / "Dockerfile").read_text().splitlines()
              if line.startswith("COPY ")}
    assert {p.rstrip("*") for p in packages} <= copied
