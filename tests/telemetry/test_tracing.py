"""Tracing turned on only by the standard OTEL_* environment, and trace context carried as a W3C traceparent."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from telemetry import tracing
from tests.helpers import REPO, pdserve_argv
from tests.otlp_collector import OtlpCollector
from tests.otlp_http_collector import OtlpHttpCollector

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
@pytest.mark.parametrize("protocol", ["http/json", "thrift"])
def test_an_otlp_protocol_pdserve_lacks_is_refused_naming_the_variable_and_the_allowed_values(otel_env, variable,
                                                                                            protocol):
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    otel_env.setenv(variable, protocol)
    with pytest.raises(tracing.TracingSetupError, match=f"{variable}='{protocol}'.*grpc or http/protobuf"):
        tracing.configure_from_env("pdserve-prefill")
    assert not tracing.enabled()


@pytest.mark.parametrize(("general", "traces", "chosen"), [
    ("grpc", "http/protobuf", "http/protobuf"),
    ("http/protobuf", "grpc", "grpc"),
    ("http/json", "http/protobuf", "http/protobuf"),  # the general one is not even read
    ("http/protobuf", "", "http/protobuf"),
])
def test_the_traces_protocol_variable_wins_over_the_general_one(otel_env, general, traces, chosen):
    otel_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", general)
    otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", traces)
    assert tracing.otlp_protocol() == chosen


def test_otlp_without_a_protocol_is_grpc_as_the_python_sdks_own_otlp_exporter_is(otel_env):
    """pdserve's default is the Python SDK's (spec: http/protobuf, unless an SDK already shipped grpc as its
    default), so a deployment that points OTEL_EXPORTER_OTLP_ENDPOINT at a gRPC port keeps its spans."""
    from opentelemetry.sdk._configuration import _get_exporter_entry_point

    assert tracing.otlp_protocol() == "grpc"
    # If the SDK ever switches its default, this fails and pdserve's default must be weighed again.
    assert _get_exporter_entry_point("otlp", "traces") == "otlp_proto_grpc"


def export_one_span(name: str) -> None:
    """Configure tracing from the environment, end one span and flush it out (shutdown exports what is batched)."""
    assert tracing.configure_from_env("pdserve-test") is True
    tracing.tracer().start_span(name).end()
    tracing.shutdown()


def test_spans_reach_a_grpc_collector_when_no_protocol_is_named(otel_env):
    collector = OtlpCollector()
    try:
        otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{collector.port}")
        export_one_span("over-grpc")
        assert [s.name for s in collector.spans] == ["over-grpc"]
    finally:
        collector.stop()


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"])
def test_over_http_protobuf_spans_reach_v1_traces_under_the_base_endpoint(otel_env, variable):
    collector = OtlpHttpCollector()
    try:
        otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.base_url + "/")  # a trailing slash is no second one
        otel_env.setenv(variable, "http/protobuf")
        export_one_span("over-http")
        assert [s.name for s in collector.spans] == ["over-http"]
        assert collector.paths == ["/v1/traces"]
    finally:
        collector.stop()


def test_over_http_protobuf_the_traces_endpoint_is_used_as_it_is(otel_env):
    collector = OtlpHttpCollector(path="/ingest/otlp")
    try:
        otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.base_url)  # would be /v1/traces: a 404 here
        otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", collector.base_url + "/ingest/otlp")
        otel_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        export_one_span("to-the-traces-endpoint")
        assert [s.name for s in collector.spans] == ["to-the-traces-endpoint"]
        assert collector.paths == ["/ingest/otlp"]
    finally:
        collector.stop()


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
@pytest.mark.parametrize(("variables", "named"), [
    ({"OTEL_TRACES_EXPORTER": "jaeger"}, "OTEL_TRACES_EXPORTER='jaeger'"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
     "OTEL_EXPORTER_OTLP_PROTOCOL='http/json'"),
], ids=["unknown-exporter", "http-json"])
def test_a_worker_asked_for_tracing_it_cannot_do_exits_with_a_clear_error(variables, named):
    result = subprocess.run(pdserve_argv("worker", "--role", "decode", "--simulate", "--port", "0"), cwd=REPO,
                            capture_output=True, text=True, timeout=60, env={
                                **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, **variables})
    assert result.returncode == 2
    assert named in result.stderr and "Traceback" not in result.stderr
