"""Tracing turned on only by the standard OTEL_* environment, and trace context carried as a W3C traceparent."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from telemetry import tracing
from tests.helpers import REPO, pdserve_argv

OTEL_VARIABLES = ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                  "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES",
                  "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")


@pytest.fixture
def otel_env(monkeypatch):
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    tracing.shutdown()


def test_nothing_is_traced_or_exported_when_the_environment_does_not_ask(otel_env):
    assert tracing.configure_from_env("pdserve-coordinator") is False
    assert not tracing.enabled()


@pytest.mark.parametrize("variables", [
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"},
    {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4317"},
    {"OTEL_TRACES_EXPORTER": "console"},
], ids=["otlp-endpoint", "otlp-traces-endpoint", "console"])
def test_an_exporter_or_an_otlp_endpoint_in_the_environment_turns_tracing_on(otel_env, variables):
    for name, value in variables.items():
        otel_env.setenv(name, value)
    assert tracing.configure_from_env("pdserve-decode") is True
    assert tracing.enabled()
    resource = tracing.tracer().resource
    assert resource.attributes["service.name"] == "pdserve-decode"


@pytest.mark.parametrize("variables", [
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_SDK_DISABLED": "true"},
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_TRACES_EXPORTER": "none"},
], ids=["sdk-disabled", "exporter-none"])
def test_the_sdk_switches_turn_tracing_off(otel_env, variables):
    for name, value in variables.items():
        otel_env.setenv(name, value)
    assert tracing.configure_from_env("pdserve-decode") is False


def test_otel_service_name_wins_over_the_roles_name(otel_env):
    otel_env.setenv("OTEL_TRACES_EXPORTER", "console")
    otel_env.setenv("OTEL_SERVICE_NAME", "decode-eu-1")
    tracing.configure_from_env("pdserve-decode")
    assert tracing.tracer().resource.attributes["service.name"] == "decode-eu-1"


def test_a_service_name_in_otel_resource_attributes_wins_over_the_roles_name(otel_env):
    otel_env.setenv("OTEL_TRACES_EXPORTER", "console")
    otel_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=prefill-pool-b,deployment.environment=staging")
    tracing.configure_from_env("pdserve-prefill")
    attributes = tracing.tracer().resource.attributes
    assert attributes["service.name"] == "prefill-pool-b" and attributes["deployment.environment"] == "staging"


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"])
def test_an_otlp_protocol_other_than_grpc_is_refused_not_silently_lost(otel_env, variable):
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    otel_env.setenv(variable, "http/protobuf")
    with pytest.raises(tracing.TracingSetupError, match=f"{variable}='http/protobuf'.*grpc only"):
        tracing.configure_from_env("pdserve-prefill")
    assert not tracing.enabled()


def test_an_exporter_pdserve_cannot_provide_is_named_in_the_error(otel_env):
    otel_env.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(tracing.TracingSetupError, match="OTEL_TRACES_EXPORTER='zipkin'.*otlp, console or none"):
        tracing.configure_from_env("pdserve-prefill")


def test_a_traceparent_names_the_span_it_was_made_from(span_exporter):
    span = tracing.tracer().start_span("attempt")
    parent = tracing.context_from_traceparent(tracing.traceparent_of(span))
    child = tracing.record_span("decode", time.monotonic() - 0.25, time.monotonic(), parent)
    span.end()
    assert child.parent.span_id == span.context.span_id and child.context.trace_id == span.context.trace_id
    assert child.parent.is_remote


@pytest.mark.parametrize("traceparent", ["", "garbage", "00-00000000000000000000000000000000-0000000000000000-01"])
def test_an_empty_or_invalid_traceparent_gives_no_parent(traceparent):
    assert tracing.context_from_traceparent(traceparent) is None


def test_a_span_recorded_afterwards_keeps_its_measured_duration(span_exporter):
    started = time.perf_counter()
    span = tracing.record_span("kv_transfer", started, started + 0.0125, None,
                               clock=tracing.WallClock(time.perf_counter))
    assert abs(span.end_time - span.start_time - 12_500_000) < 1000  # within a microsecond: float seconds


@pytest.mark.system
def test_a_worker_asked_for_an_unknown_exporter_exits_with_a_clear_error():
    result = subprocess.run(pdserve_argv("worker", "--role", "decode", "--simulate", "--port", "0"), cwd=REPO,
                            capture_output=True, text=True, timeout=60, env={
                                **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
                                "OTEL_TRACES_EXPORTER": "jaeger"})
    assert result.returncode == 2
    assert "OTEL_TRACES_EXPORTER='jaeger'" in result.stderr and "Traceback" not in result.stderr
