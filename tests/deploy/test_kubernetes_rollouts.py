"""Every pdserve role in deploy/kubernetes can be rolled to a new image without losing a request: each role
(coordinator, prefill, decode, encode) is a Deployment that surges one pod and takes none down until the new one is
available (a worker's registered with every coordinator by then), and every pod sleeps in preStop, then drains within
a grace period that covers the sleep, its drain budget and the shutdown after it."""

from __future__ import annotations

import json

import pytest

from coordinator.config import parse_config
from tests.deploy.test_deploy_files import mounted_files, pdserve_args, shell_line
from tests.deploy.test_kubernetes_manifests import OBJECTS, object_id

# Kubernetes' default terminationGracePeriodSeconds, for a pod that sets none.
DEFAULT_GRACE_S = 30
# What a pod does after its drain budget and before it exits: a worker deregisters first (an HTTPS call of up to
# 5 s), stops its gRPC server (1 s grace) and frees its engine; a coordinator steps down in etcd
# (backup_config.etcd_timeout_s) and closes its listeners.
SHUTDOWN_MARGIN_S = 10
# The least preStop sleep that lets kube-proxy and the Services' clients drop a terminating pod's endpoints.
LEAST_PRESTOP_S = 2
ROLES = {"coordinator", "prefill", "decode", "encode"}
DOCS = [doc for _, doc in OBJECTS]
# Every kind that runs pods from a template: a pdserve role moved to any of them is still found, and checked.
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet"}
# Kubernetes' default progressDeadlineSeconds, for a Deployment that sets none.
DEFAULT_PROGRESS_DEADLINE_S = 600


def runs_pdserve(container: dict) -> bool:
    """The container's process is pdserve: the image's entrypoint with a subcommand, or a `sh -c` line exec-ing it."""
    words = shell_line(container)
    if words is not None:
        return "pdserve" in words
    return container.get("command") is None and container.get("args", [None])[0] in ("coordinator", "worker")


def pdserve_workloads() -> list[tuple[str, dict]]:
    return [(object_id(path, doc), doc) for path, doc in OBJECTS if doc["kind"] in WORKLOAD_KINDS
            and any(runs_pdserve(c) for c in doc["spec"]["template"]["spec"]["containers"])]


WORKLOADS = pdserve_workloads()
WORKERS = [(name, doc) for name, doc in WORKLOADS
           if doc["spec"]["template"]["metadata"]["labels"]["role"] != "coordinator"]
CONTAINERS = [(f"{name}/{container['name']}", doc, container) for name, doc in WORKLOADS
              for container in doc["spec"]["template"]["spec"]["containers"] if runs_pdserve(container)]


def role(workload: dict) -> str:
    return workload["spec"]["template"]["metadata"]["labels"]["role"]


def coordinator_config_of(workload: dict, container: dict):
    """The coordinator config this container runs: the mounted ConfigMap file its `sh -c` line copies."""
    pod = workload["spec"]["template"]["spec"]
    name, key = mounted_files(DOCS, pod, container)[shell_line(container)[2]]
    configmap = next(d for d in DOCS if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name)
    raw = json.loads(configmap["data"][key])
    return raw, parse_config(raw, key)


def drain_budget_s(workload: dict, container: dict) -> float:
    """How long the process keeps finishing requests after SIGTERM."""
    if role(workload) == "coordinator":
        return coordinator_config_of(workload, container)[1].http_config.drain_seconds
    return pdserve_args(container).drain_seconds


def prestop_sleep_s(container: dict) -> float:
    """The seconds a container's preStop hook sleeps (an exec of sleep, or the sleep action); 0 without one."""
    hook = container.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0
    if "sleep" in hook:
        return hook["sleep"]["seconds"]
    command = hook.get("exec", {}).get("command", [])
    assert len(command) == 2 and command[0] == "sleep", f"preStop {command} is not a plain sleep"
    return float(command[1])


def shared_coordinator_config():
    (deployment,) = [doc for _, doc in WORKLOADS if role(doc) == "coordinator"]
    container = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if runs_pdserve(c))
    return coordinator_config_of(deployment, container)[1]


def test_the_rollout_checks_see_a_coordinator_a_prefill_a_decode_and_an_encode_workload():
    # A role that dropped out of the selection above (another command, another kind) would escape every check.
    assert sorted(role(doc) for _, doc in WORKLOADS) == sorted(ROLES)


@pytest.mark.parametrize(("name", "workload"), WORKLOADS, ids=[w[0] for w in WORKLOADS])
def test_every_role_is_a_deployment_that_rolls_one_extra_pod_at_a_time_with_none_unavailable(name, workload):
    # A StatefulSet can neither surge nor keep every pod up (it stops a pod before starting its replacement): with
    # one replica its role would have no pod during an upgrade. Workers need no stable identity (they register
    # their pod IP), so every role is a Deployment: a new pod must be available before an old one is stopped
    # (maxUnavailable 0), one at a time (maxSurge 1).
    assert workload["kind"] == "Deployment", f"{name}: a {workload['kind']} cannot surge"
    assert workload["spec"].get("strategy") == {"type": "RollingUpdate",
                                                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}, name


@pytest.mark.parametrize(("name", "workload"), WORKERS, ids=[w[0] for w in WORKERS])
def test_every_worker_counts_as_available_only_once_its_registration_reached_every_coordinator(name, workload):
    # A worker's readiness probe is grpc.health.v1, SERVING as soon as its gRPC server serves; it registers in the
    # background right after. minReadySeconds keeps the old worker until the new one's registration has reached
    # every coordinator (through etcd), with a heartbeat to spare.
    config = shared_coordinator_config()
    needed = config.backup_config.sync_interval_s + config.health_config.heartbeat_interval_s
    assert workload["spec"].get("minReadySeconds", 0) >= needed, f"{name}: minReadySeconds under {needed}"


@pytest.mark.parametrize(("name", "workload"), WORKLOADS, ids=[w[0] for w in WORKLOADS])
def test_each_rollouts_progress_deadline_outlasts_a_new_pods_start(name, workload):
    # Past progressDeadlineSeconds without a new pod available, the rollout is reported failed (kubectl rollout
    # status exits 1): that must not happen to a worker still loading its model within its startup probe's budget.
    spec = workload["spec"]
    startup = 0
    for container in spec["template"]["spec"]["containers"]:
        probe = container.get("startupProbe")
        if probe is not None:
            startup = max(startup, probe.get("initialDelaySeconds", 0)
                          + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3))
    needed = startup + spec.get("minReadySeconds", 0)
    deadline = spec.get("progressDeadlineSeconds", DEFAULT_PROGRESS_DEADLINE_S)
    assert deadline > needed, f"{name}: progressDeadlineSeconds {deadline} <= startup {startup} + minReadySeconds"


@pytest.mark.parametrize(("name", "workload", "container"), CONTAINERS, ids=[c[0] for c in CONTAINERS])
def test_every_pdserve_container_sleeps_in_prestop_before_its_sigterm(name, workload, container):
    # The kubelet sends SIGTERM only after preStop: until then the pod keeps serving while its endpoints go.
    assert prestop_sleep_s(container) >= LEAST_PRESTOP_S, f"{name} has no preStop sleep of {LEAST_PRESTOP_S} s"


@pytest.mark.parametrize(("name", "workload", "container"), CONTAINERS, ids=[c[0] for c in CONTAINERS])
def test_each_pods_grace_period_covers_its_prestop_and_drain_budget(name, workload, container):
    # The grace period counts from the start of preStop; past it the kubelet kills the process mid-drain.
    grace = workload["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE_S)
    needed = prestop_sleep_s(container) + drain_budget_s(workload, container) + SHUTDOWN_MARGIN_S
    assert grace >= needed, (f"{name}: terminationGracePeriodSeconds {grace} < preStop {prestop_sleep_s(container)} "
                             f"+ drain {drain_budget_s(workload, container)} + margin {SHUTDOWN_MARGIN_S}")


@pytest.mark.parametrize(("name", "workload", "container"), CONTAINERS, ids=[c[0] for c in CONTAINERS])
def test_each_drain_budget_the_grace_period_counts_on_is_set_in_the_manifest(name, workload, container):
    # Not a code default, which could grow past the grace period unseen.
    if role(workload) == "coordinator":
        raw, _ = coordinator_config_of(workload, container)
        assert "drain_seconds" in raw.get("http_config", {}), f"{name}: no http_config.drain_seconds"
    else:
        assert "--drain-seconds" in container["args"], f"{name}: no --drain-seconds"
