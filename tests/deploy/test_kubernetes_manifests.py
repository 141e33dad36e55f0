"""Every object in deploy/kubernetes is valid for a pinned Kubernetes version, offline (kubernetes-validate's
bundled schemas), strictly: an unknown or misspelt field fails here instead of being dropped by the API server."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.helpers import REPO

KUBERNETES = REPO / "deploy" / "kubernetes"
# The version the manifests are written for; the README says it too. A kubernetes-validate release bundles the
# schemas up to its own version, so it must be at least this one.
KUBERNETES_VERSION = "1.33.0"
# pdserve behind a Gateway API inference gateway: a cluster of its own beside the one the other files make, with
# CRD kinds (InferencePool, Gateway, HTTPRoute) the pinned schemas lack. tests/deploy/test_kubernetes_gateway.py
# checks it, with these checks and those of the probe, rollout and Prometheus tests applied to its objects.
GATEWAY = KUBERNETES / "gateway.yaml"


def manifest_objects() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in sorted(KUBERNETES.rglob("*.yaml")) if path != GATEWAY
            for doc in yaml.safe_load_all(path.read_text()) if doc]


OBJECTS = manifest_objects()


def object_id(path: Path, doc: dict) -> str:
    return f"{path.relative_to(KUBERNETES)}:{doc['kind']}/{doc['metadata']['name']}"


def test_every_manifest_file_holds_objects_to_validate():
    # Otherwise a file that no longer parses into objects (all comments, say) would drop out of the check unseen.
    assert {path for path, _ in OBJECTS} | {GATEWAY} == set(KUBERNETES.rglob("*.yaml"))


@pytest.mark.parametrize(("path", "doc"), OBJECTS, ids=[object_id(p, d) for p, d in OBJECTS])
def test_manifest_object_is_valid_for_the_pinned_kubernetes_version(path: Path, doc: dict):
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        # The default message prints the whole schema; the field and the reason are what matter.
        pytest.fail(f"{object_id(path, doc)} at {exc.json_path}: {exc.message} (Kubernetes {KUBERNETES_VERSION})")


def test_each_autoscaler_scales_a_worker_deployment_on_the_planners_metric_for_its_role():
    from coordinator.metrics import PlannerCollector

    class Planner:  # what the collector reads, with desired counts (encode workers running)
        decisions, last, deciding = {}, None, True
        damper = type("Damper", (), {"desired": (2, 3)})()

        @staticmethod
        def describe_counts(which):
            return {"prefill": 1, "decode": 1, "encode": 1} if which == "current" else \
                {"prefill": 2, "decode": 3, "encode": 2}

    exported = {family.name: family for family in PlannerCollector(Planner()).collect()}
    deployments = {doc["metadata"]["name"]: doc for _, doc in OBJECTS if doc["kind"] == "Deployment"}
    autoscalers = [doc for _, doc in OBJECTS if doc["kind"] == "HorizontalPodAutoscaler"]
    assert {a["spec"]["scaleTargetRef"]["name"] for a in autoscalers} == {"pdserve-prefill", "pdserve-decode",
                                                                         "pdserve-encode"}
    for autoscaler in autoscalers:
        ref = autoscaler["spec"]["scaleTargetRef"]
        # The kind must be the workload's own: an HPA whose target kind is wrong finds nothing to scale.
        assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment"), ref
        target = deployments[ref["name"]]
        role = target["spec"]["template"]["metadata"]["labels"]["role"]
        (metric,) = autoscaler["spec"]["metrics"]
        assert metric["external"]["metric"]["selector"]["matchLabels"] == {"role": role}
        family = exported[metric["external"]["metric"]["name"]]
        assert [sample.labels for sample in family.samples] == [{"role": "prefill"}, {"role": "decode"},
                                                                {"role": "encode"}]
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
