"""The metrics reference: every Prometheus metric the coordinator and the workers register, read from fresh
registries built in-process (nothing is served or scraped)."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from coordinator.workers.instances import InstanceRegistry
from coordinator.scheduling.kv_index import KvIndex
from coordinator.gateway.gie_metrics import GatewayMetrics
from coordinator.gateway.sidecar_directory import SidecarDirectory
from coordinator.metrics import CoordinatorMetrics
from coordinator.planning.planner_loop import PlannerLoop
from coordinator.requests.draft_corpus import DraftCorpus, SpeculativeConfig
from planner.settings import PlannerConfig
from coordinator.tenancy.admission import TenantBook
from coordinator.tenancy.settings import TenancyConfig
from docs_gen.markdown import banner, cell, table
from worker.engine.block_pool import BlockPool
from worker.metrics import ProcessMetrics, WorkerMetrics

INTRO = """# Metrics

The coordinator serves these on `GET /metrics` of its predict and management ports; each worker serves its own
on `--metrics-port` (0 picks a free port, printed as `pdserve worker metrics: URL`; -1 turns it off). What they
mean in operation, and the dashboard built on them: [Monitoring](../operating/monitoring.md).
"""

EXPOSED_SUFFIX = {"counter": "_total"}  # prometheus_client names a counter family without the suffix it exposes


def families(registry: CollectorRegistry):
    """(family, label names) of every metric registered. A labelled prometheus_client metric has no samples, and
    so shows no label names, until its first use, and a gauge set_function reads its engine when collected: a
    wrapper is described from its own fields instead; a custom collector is collected (its families carry their
    label names)."""
    for collector in registry._collector_to_names:
        if hasattr(collector, "_labelnames") and hasattr(collector, "describe"):  # Counter, Gauge, Histogram
            for family in collector.describe():
                yield family, tuple(collector._labelnames)
        else:
            for family in collector.collect():
                yield family, tuple(getattr(family, "_labelnames", ()))


def metric_rows(registry: CollectorRegistry) -> dict[str, list[str]]:
    rows = {}
    for family, labels in families(registry):
        name = family.name + EXPOSED_SUFFIX.get(family.type, "")
        rows[name] = [f"`{name}`", family.type, ", ".join(f"`{label}`" for label in labels),
                      cell(family.documentation)]
    return rows


def coordinator_rows() -> list[list[str]]:
    metrics = CoordinatorMetrics()
    metrics.watch(SimpleNamespace(num_waiting=0), InstanceRegistry(), KvIndex())  # cache_affinity's too
    metrics.watch_planner(PlannerLoop(PlannerConfig(enabled=True), InstanceRegistry(), "round_robin"))
    metrics.watch_tenants(TenantBook(TenancyConfig()))
    metrics.watch_drafts(DraftCorpus(SpeculativeConfig(enabled=True), "model"))
    metrics.registry.register(GatewayMetrics("pool", InstanceRegistry(), SidecarDirectory(15)))  # the picker's
    return sorted(metric_rows(metrics.registry).values())


def worker_rows() -> list[list[str]]:
    """Both roles' metrics; a metric only one role registers says so."""
    # Read when scraped; a vision-language model's runner adds its encoder cache's counters.
    engine = SimpleNamespace(admission=SimpleNamespace(budget=None), pool=BlockPool(2, 16),
                             runner=SimpleNamespace(vision=SimpleNamespace(cache=SimpleNamespace(hits=0, misses=0))))
    by_role = {role: metric_rows(WorkerMetrics(role, engine).registry) for role in ("prefill", "decode")}
    for role in by_role:  # what outlives a role switch: the process's own counters
        by_role[role].update(metric_rows(ProcessMetrics().registry))
    rows = []
    for name in sorted(by_role["prefill"].keys() | by_role["decode"].keys()):
        roles = [role for role in by_role if name in by_role[role]]
        row = list(by_role[roles[0]][name])
        rows.append([row[0], "both" if len(roles) == 2 else roles[0], *row[1:]])
    return rows


def render() -> str:
    return "\n".join([
        banner("coordinator/metrics.py and worker/metrics.py"), INTRO,
        "## Coordinator\n", table(["metric", "type", "labels", "help"], coordinator_rows()),
        "## Workers\n", table(["metric", "role", "type", "labels", "help"], worker_rows()),
    ])
