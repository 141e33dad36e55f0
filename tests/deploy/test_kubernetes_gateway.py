"""deploy/kubernetes/gateway.yaml, pdserve behind a Gateway API inference gateway, is valid and hangs together.

Its built-in kinds are validated as every other manifest is (kubernetes-validate, strictly, for the pinned Kubernetes
version); its CRD kinds, which those schemas lack, against the required fields of GIE's InferencePool v1 and Gateway
API v1's Gateway and HTTPRoute, written out below. Then the references between its objects: the pool selects the
decode pods and reaches their sidecars, its endpoint picker is the EPP's Service and ext_proc port, the route sends
to the pool, workers and sidecars reach the EPP's management port; every container runs a pdserve subcommand that
exists with flags it takes; and the probe, rollout and Prometheus checks of the other manifest tests, applied here.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from coordinator.config import CoordinatorConfig, parse_config
from launcher.cli import build_parser
from security.settings import load_security_file
from tests.deploy import test_kubernetes_probes as probes
from tests.deploy import test_kubernetes_rollouts as rollouts
from tests.deploy import test_prometheus_config as prometheus
from tests.deploy.test_deploy_files import mounted_files, of_kind, selects, shell_line
from tests.deploy.test_kubernetes_manifests import GATEWAY, KUBERNETES, KUBERNETES_VERSION

DOCS = [doc for doc in yaml.safe_load_all(GATEWAY.read_text()) if doc]
# What gateway.yaml uses and does not define: etcd.yaml's Service and the Secrets' template.
SHARED = [doc for path in (KUBERNETES / "etcd.yaml", KUBERNETES / "secrets" / "pdserve-secrets.yaml")
          for doc in yaml.safe_load_all(path.read_text()) if doc]
ALL = DOCS + SHARED
# pdserve.yaml's cluster: the pool must not take its pods, nor its Deployments adopt these.
CLASSIC = [doc for path in sorted(KUBERNETES.glob("*.yaml")) if path != GATEWAY
           for doc in yaml.safe_load_all(path.read_text()) if doc]

GIE = "inference.networking.k8s.io"
GATEWAY_API = "gateway.networking.k8s.io"
# The command lines of the brief that introduced the gateway (docs/operating/gateway.md):
#   pdserve coordinator --config FILE --epp-port 9002
#   pdserve sidecar --config FILE --decode POD_IP:GRPC_PORT --port 8000 --advertise POD_IP:8000 --announce URL
# checked against the CLI where it has them, and against these names where it does not yet.
BRIEF_FLAGS = {"coordinator": {"--config", "--epp-port"},
               "sidecar": {"--config", "--decode", "--port", "--advertise", "--announce"}}
EPP_HEALTH = {"readinessProbe": "readiness", "livenessProbe": ""}  # grpc.health.v1 names on the ext_proc port

_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_LABELS = {"type": "object", "minProperties": 1, "additionalProperties": {"type": "string", "maxLength": 63}}
_METADATA = {"type": "object", "required": ["name"], "properties": {"name": _NAME}}


def _object(api_version: str, kind: str, spec: dict) -> dict:
    return {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
            "properties": {"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": _METADATA,
                           "spec": spec}}


# GIE v1 (inference.networking.k8s.io/v1, InferencePoolSpec): every spec field, strictly, as the CRD has them.
INFERENCE_POOL = _object(f"{GIE}/v1", "InferencePool", {
    "type": "object", "required": ["selector", "targetPorts", "endpointPickerRef"], "additionalProperties": False,
    "properties": {
        "selector": {"type": "object", "required": ["matchLabels"], "additionalProperties": False,
                     "properties": {"matchLabels": _LABELS}},
        "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8,
                        "items": {"type": "object", "required": ["number"], "additionalProperties": False,
                                  "properties": {"number": _PORT}}},
        "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
        "endpointPickerRef": {
            "type": "object", "required": ["name", "port"], "additionalProperties": False,
            "properties": {"group": {"type": "string"}, "kind": {"type": "string", "minLength": 1},
                           "name": _NAME,
                           "port": {"type": "object", "required": ["number"], "additionalProperties": False,
                                    "properties": {"number": _PORT}},
                           "failureMode": {"enum": ["FailOpen", "FailClose"]}}},
    }})
_PARENT_REF = {"type": "object", "required": ["name"],
               "properties": {"group": {"type": "string"}, "kind": {"type": "string"}, "name": _NAME,
                              "sectionName": _NAME, "port": _PORT}}
# Gateway API v1: the required fields, and the shapes of those this file sets.
GATEWAY_SCHEMA = _object(f"{GATEWAY_API}/v1", "Gateway", {
    "type": "object", "required": ["gatewayClassName", "listeners"],
    "properties": {
        "gatewayClassName": _NAME,
        "listeners": {"type": "array", "minItems": 1, "maxItems": 64,
                      "items": {"type": "object", "required": ["name", "port", "protocol"],
                                "properties": {"name": _NAME, "port": _PORT, "protocol": {"type": "string"},
                                               "hostname": {"type": "string"}}}},
    }})
HTTP_ROUTE = _object(f"{GATEWAY_API}/v1", "HTTPRoute", {
    "type": "object", "required": ["parentRefs", "rules"],
    "properties": {
        "parentRefs": {"type": "array", "minItems": 1, "maxItems": 32, "items": _PARENT_REF},
        "rules": {"type": "array", "minItems": 1, "maxItems": 16, "items": {
            "type": "object", "required": ["backendRefs"],
            "properties": {
                "matches": {"type": "array", "items": {"type": "object", "properties": {"path": {
                    "type": "object", "properties": {"type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                                     "value": {"type": "string"}}}}}},
                "backendRefs": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["name"],
                    "properties": {"group": {"type": "string"}, "kind": {"type": "string"}, "name": _NAME,
                                   "port": _PORT, "weight": {"type": "integer", "minimum": 0}}}},
                "timeouts": {"type": "object", "properties": {
                    "request": {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"},
                    "backendRequest": {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}}},
            }}},
    }})
CRD_SCHEMAS = {"InferencePool": INFERENCE_POOL, "Gateway": GATEWAY_SCHEMA, "HTTPRoute": HTTP_ROUTE}


def object_id(doc: dict) -> str:
    return f"gateway.yaml:{doc['kind']}/{doc['metadata']['name']}"


BUILT_IN = [doc for doc in DOCS if doc["kind"] not in CRD_SCHEMAS]
CUSTOM = [doc for doc in DOCS if doc["kind"] in CRD_SCHEMAS]


def one(kind: str) -> dict:
    (doc,) = of_kind(DOCS, kind).values()
    return doc


def role(workload: dict) -> str:
    return workload["spec"]["template"]["metadata"]["labels"]["role"]


def workload(role_name: str) -> dict:
    (found,) = [d for d in of_kind(DOCS, "Deployment").values() if role(d) == role_name]
    return found


def container(workload_doc: dict, name: str) -> dict:
    return next(c for c in workload_doc["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def pdserve_argv(c: dict) -> list[str]:
    """The words after `pdserve` on the container's command line: its `sh -c` line's, or the image's entrypoint
    (deploy/Dockerfile's ENTRYPOINT ["pdserve"]) with the container's args."""
    words = shell_line(c)
    if words is not None:
        assert "pdserve" in words, f"{c['name']}: its shell line runs no pdserve: {words}"
        assert words[words.index("pdserve") - 1] == "exec", f"{c['name']}: pdserve must be exec'd (its SIGTERM)"
        return words[words.index("pdserve") + 1:]
    assert c.get("command") is None, f"{c['name']}: a command other than the image's pdserve: {c['command']}"
    return c["args"]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def cli_args(c: dict) -> argparse.Namespace | dict[str, str]:
    """The container's pdserve command line, parsed by the CLI; where the CLI lacks the brief's subcommand or a flag
    yet, its `--flag value` pairs, checked against the brief's names."""
    argv = pdserve_argv(c)
    command, rest = argv[0], argv[1:]
    parsers = subcommands()
    if command in parsers:
        known = {o for a in parsers[command]._actions for o in a.option_strings}
        if not {w for w in rest if w.startswith("--")} - known:
            return build_parser().parse_args(argv)
    assert command in BRIEF_FLAGS, f"{c['name']}: pdserve {command} is no subcommand ({sorted(parsers)})"
    assert len(rest) % 2 == 0 and set(rest[::2]) <= BRIEF_FLAGS[command], f"{c['name']}: pdserve {command} {rest}"
    return dict(zip(rest[::2], rest[1::2]))


def arg(parsed: argparse.Namespace | dict[str, str], flag: str):
    if isinstance(parsed, dict):
        return parsed.get(flag)
    return getattr(parsed, flag.removeprefix("--").replace("-", "_"))


def config_json(key: str) -> dict:
    return json.loads(one("ConfigMap")["data"][key])


def config_of(c: dict, pod: dict) -> tuple[str, dict]:
    """The ConfigMap key a pdserve container's --config names (through its `sh -c` copy, if any), and its JSON."""
    words = shell_line(c)
    path = words[2] if words is not None else arg(cli_args(c), "--config")
    name, key = mounted_files(ALL, pod, c)[path]
    assert name == one("ConfigMap")["metadata"]["name"]
    return key, config_json(key)


def one_of(found: list[dict], what: str) -> dict:
    assert len(found) == 1, f"gateway.yaml: {len(found)} containers run {what}, not one"
    return found[0]


EPP = workload("epp")
EPP_POD = EPP["spec"]["template"]["spec"]
EPP_CONTAINER = one_of([c for c in EPP_POD["containers"] if pdserve_argv(c)[0] == "coordinator"], "pdserve coordinator")
DECODE = workload("decode")
DECODE_POD = DECODE["spec"]["template"]["spec"]
SIDECAR = one_of([c for c in DECODE_POD["containers"] if pdserve_argv(c)[0] == "sidecar"], "pdserve sidecar")
WORKER_DEPLOYMENTS = [workload("prefill"), DECODE]


def epp_config() -> tuple[dict, CoordinatorConfig]:
    key, raw = config_of(EPP_CONTAINER, EPP_POD)
    return raw, parse_config(raw, key)


def sidecar_config() -> tuple[dict, CoordinatorConfig]:
    key, raw = config_of(SIDECAR, DECODE_POD)
    return raw, parse_config(raw, key)


def services_selecting(labels: dict) -> list[dict]:
    return [s for s in of_kind(DOCS, "Service").values() if selects(s["spec"]["selector"], labels)]


def service_port(service: dict, number: int) -> dict:
    found = [p for p in service["spec"]["ports"] if p["port"] == number]
    assert found, f"Service {service['metadata']['name']} exposes no port {number}"
    return found[0]


def target_port(service_port_entry: dict, c: dict) -> int:
    target = service_port_entry.get("targetPort", service_port_entry["port"])
    if isinstance(target, int):
        return target
    return next(p["containerPort"] for p in c["ports"] if p.get("name") == target)


# -- validity --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", BUILT_IN, ids=[object_id(d) for d in BUILT_IN])
def test_built_in_object_is_valid_for_the_pinned_kubernetes_version(doc: dict):
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{object_id(doc)} at {exc.json_path}: {exc.message} (Kubernetes {KUBERNETES_VERSION})")


@pytest.mark.parametrize("doc", CUSTOM, ids=[object_id(d) for d in CUSTOM])
def test_crd_object_has_the_fields_its_api_requires(doc: dict):
    try:
        jsonschema.validate(doc, CRD_SCHEMAS[doc["kind"]])
    except jsonschema.ValidationError as exc:
        pytest.fail(f"{object_id(doc)} at {exc.json_path}: {exc.message}")


def test_the_crd_schemas_catch_a_missing_or_misspelt_field():
    pool = one("InferencePool")
    for broken in ({**pool, "spec": {k: v for k, v in pool["spec"].items() if k != "targetPorts"}},
                   {**pool, "spec": {**pool["spec"], "targetPortNumber": 8000}},  # the v1alpha2 name
                   {**pool, "apiVersion": "inference.networking.x-k8s.io/v1alpha2"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, INFERENCE_POOL)


def test_the_file_has_each_part_once():
    kinds = sorted(doc["kind"] for doc in DOCS)
    assert kinds.count("InferencePool") == kinds.count("Gateway") == kinds.count("HTTPRoute") == 1, kinds
    assert sorted(role(d) for d in of_kind(DOCS, "Deployment").values()) == ["decode", "epp", "prefill"]
    # Names and pods of their own: applied beside pdserve.yaml, neither file overwrites or adopts the other's.
    for kind in {d["kind"] for d in DOCS} & {d["kind"] for d in CLASSIC}:
        assert not set(of_kind(DOCS, kind)) & set(of_kind(CLASSIC, kind)), f"{kind} names shared with pdserve.yaml"
    classic_pods = [d["spec"]["template"]["metadata"]["labels"] for d in CLASSIC if "template" in d.get("spec", {})]
    for deployment in of_kind(DOCS, "Deployment").values():
        for labels in classic_pods:
            assert not selects(deployment["spec"]["selector"]["matchLabels"], labels), deployment["metadata"]["name"]


# -- the pool, the picker, the route ---------------------------------------------------------------------------------


def test_the_pool_selects_the_decode_pods_and_nothing_else():
    selector = one("InferencePool")["spec"]["selector"]["matchLabels"]
    assert selects(selector, DECODE["spec"]["template"]["metadata"]["labels"])
    for doc in [*DOCS, *CLASSIC]:
        if doc["kind"] in rollouts.WORKLOAD_KINDS and doc is not DECODE:
            assert not selects(selector, doc["spec"]["template"]["metadata"]["labels"]), doc["metadata"]["name"]


def test_the_pools_target_port_is_the_sidecars_port():
    ports = [p["number"] for p in one("InferencePool")["spec"]["targetPorts"]]
    parsed = cli_args(SIDECAR)
    port = int(arg(parsed, "--port"))
    assert ports == [port]
    assert [p["containerPort"] for p in SIDECAR["ports"]] == [port]
    assert arg(parsed, "--advertise") == f"$(POD_IP):{port}"  # the address the gateway dials: pod IP and targetPort
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in SIDECAR["env"]
    # The EPP finds every decode pod's sidecar at that port, announced or not yet.
    assert epp_config()[1].gateway_config.sidecar_port in (0, port)


def test_the_endpoint_picker_ref_is_the_epp_services_ext_proc_port():
    ref = one("InferencePool")["spec"]["endpointPickerRef"]
    assert ref.get("group", "") == "" and ref.get("kind", "Service") == "Service"
    assert ref.get("failureMode", "FailClose") in ("FailOpen", "FailClose")
    service = of_kind(DOCS, "Service")[ref["name"]]
    assert selects(service["spec"]["selector"], EPP["spec"]["template"]["metadata"]["labels"])
    # Only Ready EPPs take the gateway's streams.
    assert not service["spec"].get("publishNotReadyAddresses", False)
    epp_port = int(arg(cli_args(EPP_CONTAINER), "--epp-port"))
    assert target_port(service_port(service, ref["port"]["number"]), EPP_CONTAINER) == epp_port
    assert epp_port in {p["containerPort"] for p in EPP_CONTAINER["ports"]}
    _, config = epp_config()
    assert config.gateway_config.epp_port in (-1, 0, epp_port)  # unset (the flag's), or the same port
    assert config.gateway_config.pool_name == one("InferencePool")["metadata"]["name"]  # inference_pool_* labels


def test_the_route_sends_the_gateways_traffic_to_the_pool():
    route, gateway, pool = one("HTTPRoute"), one("Gateway"), one("InferencePool")
    listeners = {listener["name"] for listener in gateway["spec"]["listeners"]}
    for parent in route["spec"]["parentRefs"]:
        assert (parent.get("group", GATEWAY_API), parent.get("kind", "Gateway")) == (GATEWAY_API, "Gateway")
        assert parent["name"] == gateway["metadata"]["name"]
        assert parent.get("sectionName", next(iter(listeners))) in listeners
    for rule in route["spec"]["rules"]:
        for backend in rule["backendRefs"]:
            assert (backend.get("group"), backend.get("kind"), backend["name"]) == (GIE, "InferencePool",
                                                                                    pool["metadata"]["name"])
            assert "port" not in backend  # an InferencePool's ports are its targetPorts
    # A stream may run as long as pdserve lets it: the gateway must not cut it first.
    infer_timeout = epp_config()[1].exception_config.infer_timeout
    for rule in route["spec"]["rules"]:
        request = rule.get("timeouts", {}).get("request")
        if request is not None and request != "0s":
            assert request.endswith("s") and request[:-1].isdigit(), request
            assert int(request[:-1]) >= infer_timeout, f"HTTPRoute timeout {request} < infer_timeout {infer_timeout}"


# -- the EPP, the workers and the sidecars ---------------------------------------------------------------------------


def management_service_of(url: str, config: CoordinatorConfig) -> dict:
    """The Service a registration or announce URL names, checked against the EPP's management port."""
    parts = urlsplit(url)
    assert parts.scheme == ("https" if config.tls_config.management.tls_enable else "http"), url
    service = of_kind(DOCS, "Service")[parts.hostname]
    assert selects(service["spec"]["selector"], EPP["spec"]["template"]["metadata"]["labels"])
    assert target_port(service_port(service, parts.port), EPP_CONTAINER) == config.http_config.manage_port
    # Workers and sidecars reach an EPP that is not Ready yet: it has nothing to pick until they are there.
    assert service["spec"].get("publishNotReadyAddresses") is True
    return service


def test_the_epp_is_a_coordinator_on_its_own_etcd_prefix_with_the_ext_proc_port():
    raw, config = epp_config()
    words = shell_line(EPP_CONTAINER)
    assert words[:2] == ["sed", "s/@POD_NAME@/$POD_NAME/"]  # each replica its own name in etcd
    assert words[words.index(">") + 1] == arg(cli_args(EPP_CONTAINER), "--config")
    assert raw["backup_config"]["coordinator_name"] == "@POD_NAME@"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in EPP_CONTAINER["env"]
    assert config.backup_config.mode == "replicas"
    etcd_services = of_kind(SHARED, "Service")
    for url in config.backup_config.etcd_endpoints:
        host, port = urlsplit(url).hostname, urlsplit(url).port
        assert port in {p["port"] for p in etcd_services[host]["spec"]["ports"]}
    # Another cluster than pdserve.yaml's on the same etcd.
    classic = [json.loads(text) for d in of_kind(CLASSIC, "ConfigMap").values() for text in d["data"].values()]
    prefixes = {c["backup_config"]["key_prefix"] for c in classic if "backup_config" in c}
    assert config.backup_config.key_prefix not in prefixes
    http = config.http_config
    assert {http.predict_port, http.manage_port} <= {p["containerPort"] for p in EPP_CONTAINER["ports"]}


def test_the_epp_probes_ask_its_grpc_health_where_kubelet_can_reach_it():
    _, config = epp_config()
    epp_port = int(arg(cli_args(EPP_CONTAINER), "--epp-port"))
    for kind, service in EPP_HEALTH.items():
        probe = EPP_CONTAINER[kind]
        if config.tls_config.epp.tls_enable:
            # Kubernetes' gRPC probes speak no TLS: the coordinator's HTTPS probes on the management port then.
            get = probe.get("httpGet")
            assert get is not None and get["port"] == config.http_config.manage_port, f"{kind}: {probe}"
            assert get["scheme"] == ("HTTPS" if config.tls_config.management.tls_enable else "HTTP")
        else:
            assert probe.get("grpc") == ({"port": epp_port, "service": service} if service else {"port": epp_port}), \
                f"{kind}: {probe}"


def test_workers_register_with_the_epps_management_service(tmp_path: Path):
    _, config = epp_config()
    epp_files = mounted_files(ALL, EPP_POD, EPP_CONTAINER)
    assert sorted(role(w) for w in WORKER_DEPLOYMENTS) == ["decode", "prefill"]
    for deployment in WORKER_DEPLOYMENTS:
        pod = deployment["spec"]["template"]["spec"]
        worker = container(deployment, "worker")
        args = cli_args(worker)
        assert args.role == role(deployment)
        management_service_of(args.coordinator, config)
        assert args.advertise_host == "$(POD_IP)"
        assert {p["containerPort"] for p in worker["ports"]} == {args.port}
        files = mounted_files(ALL, pod, worker)
        name, key = files[args.security_config]
        (tmp_path / key).write_text(of_kind(DOCS, "ConfigMap")[name]["data"][key])
        security = load_security_file(str(tmp_path / key))
        assert security.tls_config.registration.tls_enable == config.tls_config.management.tls_enable
        assert files[security.tls_config.registration.ca_cert] == ("pdserve-tls", "ca.pem")
        auth, epp_auth = security.auth_config, config.auth_config
        assert files[auth.registration_token_file] == epp_files[epp_auth.registration_token_file]
        assert files[auth.worker_secret_file] == epp_files[epp_auth.worker_secret_file]
        assert "server-key.pem" not in {k for _, k in files.values()}


def test_the_sidecar_fronts_its_pods_decode_worker_and_announces_to_the_epp():
    _, epp = epp_config()
    _, sidecar = sidecar_config()
    parsed = cli_args(SIDECAR)
    worker = cli_args(container(DECODE, "worker"))
    assert arg(parsed, "--decode") == f"{worker.advertise_host}:{worker.port}"  # as the worker registers itself
    management_service_of(arg(parsed, "--announce"), epp)
    # The announcement speaks the management port's TLS, trusting the CA its certificate is from, with the token.
    files = mounted_files(ALL, DECODE_POD, SIDECAR)
    epp_files = mounted_files(ALL, EPP_POD, EPP_CONTAINER)
    registration = sidecar.tls_config.registration
    assert registration.tls_enable == epp.tls_config.management.tls_enable
    assert files[registration.ca_cert] == ("pdserve-tls", "ca.pem")
    for path, epp_path in ((sidecar.auth_config.registration_token_file, epp.auth_config.registration_token_file),
                           (sidecar.auth_config.worker_secret_file, epp.auth_config.worker_secret_file),
                           (sidecar.auth_config.api_keys_file, epp.auth_config.api_keys_file)):
        assert path and files[path] == epp_files[epp_path], path
    assert "server-key.pem" not in {k for _, k in files.values()}
    # Both ends of the announcements agree on how long one lasts; the sidecar serves the EPP's model.
    assert sidecar.gateway_config.sidecar_ttl_s == epp.gateway_config.sidecar_ttl_s
    assert sidecar.model_settings == epp.model_settings
    # Its readiness: GET /health on its own port, 200 when its decode worker is healthy.
    get = SIDECAR["readinessProbe"]["httpGet"]
    assert (get["path"], get["port"]) == ("/health", int(arg(parsed, "--port")))
    assert get.get("scheme", "HTTP") == ("HTTPS" if sidecar.tls_config.predict.tls_enable else "HTTP")
    # Its liveness must not follow the decode worker's health, or a worker restart would restart the sidecar too.
    assert SIDECAR["livenessProbe"].get("httpGet", {}).get("path") != "/health"


CONTAINERS = [(f"{object_id(d)}/{c['name']}", d, c) for d in of_kind(DOCS, "Deployment").values()
              for c in d["spec"]["template"]["spec"]["containers"]]
WORKERS = [(name, c) for name, _, c in CONTAINERS if pdserve_argv(c)[0] == "worker"]


@pytest.mark.parametrize(("name", "deployment", "c"), CONTAINERS, ids=[c[0] for c in CONTAINERS])
def test_every_container_runs_a_pdserve_subcommand_with_flags_it_takes(name, deployment, c):
    argv = pdserve_argv(c)
    assert argv[0] in {"coordinator", "worker", "sidecar"}, f"{name}: {argv}"
    cli_args(c)  # parses, or (a subcommand or flag still to come) uses the brief's names only
    if argv[0] in BRIEF_FLAGS:
        assert BRIEF_FLAGS[argv[0]] <= set(argv[1::2]), f"{name}: pdserve {argv}"


def test_every_file_a_config_names_is_mounted_from_its_secret_or_configmap():
    secrets = of_kind(SHARED, "Secret")
    for pod, c, (raw, config) in ((EPP_POD, EPP_CONTAINER, epp_config()), (DECODE_POD, SIDECAR, sidecar_config())):
        files = mounted_files(ALL, pod, c)
        for group, link in config.tls_config:
            if link.tls_enable:
                for key in ("ca_cert", "tls_cert", "tls_key"):
                    path = getattr(link, key)
                    if path:
                        assert path in files and files[path][0] in secrets, f"tls_config.{group}.{key} {path}"
        for key in ("api_keys_file", "registration_token_file", "worker_secret_file"):
            path = getattr(config.auth_config, key)
            if path:
                assert path in files and files[path][0] in secrets, f"auth_config.{key} {path}"


# -- the other manifest tests' checks, on this file ------------------------------------------------------------------


@pytest.mark.parametrize(("name", "deployment", "c"), CONTAINERS, ids=[c[0] for c in CONTAINERS])
def test_every_container_has_readiness_and_liveness_probes(name, deployment, c):
    probes.test_every_container_has_readiness_and_liveness_probes(name, c, {})


@pytest.mark.parametrize(("name", "c"), WORKERS, ids=[w[0] for w in WORKERS])
def test_worker_probes_ask_grpc_health_on_the_port_it_serves_it_on_without_tls(name, c):
    config = {key: text for key, text in one("ConfigMap")["data"].items()}
    probes.test_worker_probes_ask_grpc_health_on_the_port_it_serves_it_on_without_tls(name, c, config)


@pytest.mark.parametrize("deployment", list(of_kind(DOCS, "Deployment").values()), ids=object_id)
def test_every_role_rolls_one_extra_pod_at_a_time_with_none_unavailable_and_in_time(deployment):
    name = object_id(deployment)
    rollouts.test_every_role_is_a_deployment_that_rolls_one_extra_pod_at_a_time_with_none_unavailable(name, deployment)
    rollouts.test_each_rollouts_progress_deadline_outlasts_a_new_pods_start(name, deployment)
    if role(deployment) != "epp":
        # Available once its registration reached every EPP through etcd.
        _, config = epp_config()
        needed = config.backup_config.sync_interval_s + config.health_config.heartbeat_interval_s
        assert deployment["spec"].get("minReadySeconds", 0) >= needed, f"{name}: minReadySeconds under {needed}"


def drain_budget_s(raw: dict, c: dict) -> float:
    """The seconds a pdserve container keeps finishing requests after SIGTERM, as set in the manifest."""
    command = pdserve_argv(c)[0]
    if command == "worker":
        assert "--drain-seconds" in c["args"], f"{c['name']}: no --drain-seconds"
        return cli_args(c).drain_seconds
    assert "drain_seconds" in raw.get("http_config", {}), f"{c['name']}: no http_config.drain_seconds"
    return raw["http_config"]["drain_seconds"]


@pytest.mark.parametrize(("name", "deployment", "c"), CONTAINERS, ids=[c[0] for c in CONTAINERS])
def test_every_container_sleeps_in_prestop_and_its_grace_period_covers_its_drain(name, deployment, c):
    assert rollouts.prestop_sleep_s(c) >= rollouts.LEAST_PRESTOP_S, f"{name}: no preStop sleep"
    pod = deployment["spec"]["template"]["spec"]
    raw = config_of(c, pod)[1] if pdserve_argv(c)[0] != "worker" else {}
    grace = pod.get("terminationGracePeriodSeconds", rollouts.DEFAULT_GRACE_S)
    needed = rollouts.prestop_sleep_s(c) + drain_budget_s(raw, c) + rollouts.SHUTDOWN_MARGIN_S
    assert grace >= needed, f"{name}: terminationGracePeriodSeconds {grace} < {needed}"


def test_the_decode_and_prefill_workers_are_pdserve_yamls_but_for_the_coordinator_they_register_with():
    # gateway.yaml copies pdserve.yaml's worker pods: a change to one (image, probes, drain, resources) belongs in both.
    classic = {role(d): d for d in of_kind(CLASSIC, "Deployment").values() if role(d) in ("prefill", "decode")}
    for deployment in WORKER_DEPLOYMENTS:
        mine, theirs = container(deployment, "worker"), container(classic[role(deployment)], "worker")
        at = mine["args"].index("--coordinator") + 1
        assert {**mine, "args": mine["args"][:at] + mine["args"][at + 1:]} == \
               {**theirs, "args": theirs["args"][:at] + theirs["args"][at + 1:]}, deployment["metadata"]["name"]
        for key in ("strategy", "minReadySeconds", "progressDeadlineSeconds"):
            assert deployment["spec"].get(key) == classic[role(deployment)]["spec"].get(key), key
        pods = [d["spec"]["template"]["spec"] for d in (deployment, classic[role(deployment)])]
        assert pods[0]["terminationGracePeriodSeconds"] == pods[1]["terminationGracePeriodSeconds"]


def test_the_prometheus_job_scrapes_the_epp_and_the_workers_where_they_serve_metrics():
    job = prometheus.scrape_configs()["pdserve-kubernetes"]
    _, config = epp_config()
    expected = {"epp": ("https" if config.tls_config.management.tls_enable else "http", config.http_config.manage_port)}
    for deployment in WORKER_DEPLOYMENTS:
        expected[role(deployment)] = ("http", cli_args(container(deployment, "worker")).metrics_port)
    for deployment in of_kind(DOCS, "Deployment").values():
        results = [prometheus.relabel(t, job["relabel_configs"]) for t in prometheus.pod_targets(deployment)]
        kept = {(r.get("__scheme__", "http"), r["__address__"], r.get("__metrics_path__", "/metrics"))
                for r in results if r is not None}
        scheme, port = expected[role(deployment)]
        assert kept == {(scheme, f"{prometheus.POD_IP}:{port}", "/metrics")}, deployment["metadata"]["name"]
    # The job checks the certificate against the name pdserve.yaml's coordinators have: the EPP's is the same one.
    cert = config.tls_config.management.tls_cert
    assert mounted_files(ALL, EPP_POD, EPP_CONTAINER)[cert] == ("pdserve-tls", "server.pem")
