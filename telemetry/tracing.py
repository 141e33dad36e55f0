"""OpenTelemetry traces for a pdserve process: on when the standard OTEL_* environment asks for an exporter.

Nothing is exported unless OTEL_TRACES_EXPORTER names one (otlp, console) or an OTLP endpoint is set
(OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT); OTEL_SDK_DISABLED=true turns it all off.
OTLP goes over grpc (the default) or http/protobuf, as OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL says.
The exporter, sampler, batching and resource read their own OTEL_* variables as the SDK defines them. While off,
`enabled()` is False and callers skip span work entirely, so an untraced request pays nothing for it.
"""

from __future__ import annotations

import importlib
import logging
import os
import time

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

TRACER_NAME = "pdserve"
_PROPAGATOR = TraceContextTextMapPropagator()


class TracingSetupError(ValueError):
    """The OTEL_* environment asks for something pdserve cannot do."""

_provider = None  # the SDK TracerProvider this process exports through, once configured
_tracer: trace.Tracer = trace.NoOpTracer()  # its tracer, made once
SHUTDOWN_FLUSH_MS = 2000


def enabled() -> bool:
    """Whether spans are recorded and exported in this process."""
    return _provider is not None


def tracer() -> trace.Tracer:
    return _tracer


def _exporter_names() -> list[str]:
    names = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if names:
        return [n.strip() for n in names.split(",") if n.strip() and n.strip() != "none"]
    # The SDK's default exporter is otlp, but an unset environment must not send spans to localhost:4317.
    if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return ["otlp"]
    return []


def configure_from_env(service_name: str) -> bool:
    """Install this process's tracer provider if the environment asks for an exporter; True when tracing is on.
    TracingSetupError names a setting pdserve cannot honour (an exporter or OTLP protocol it lacks, a bad value)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    names = _exporter_names()
    if not names:
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporters = [_exporter(name) for name in names]
    # OTEL_SERVICE_NAME or a service.name in OTEL_RESOURCE_ATTRIBUTES wins over the role's name.
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    provider = TracerProvider(resource=resource)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    install(provider)
    logger.info("tracing on: exporting spans with %s", ", ".join(
        f"otlp over {otlp_protocol()}" if name == "otlp" else name for name in names))
    return True


# OTLP transports pdserve exports over: the value of OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL -> the SDK exporter's module.
OTLP_EXPORTERS = {
    "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
}
# With neither protocol variable set, grpc. The specification prefers http/protobuf but lets an SDK keep grpc where
# a stable release already defaulted to it; the Python SDK did and still does (its `otlp` exporter name resolves
# to otlp_proto_grpc when no protocol is set), and pdserve's own deployments point OTEL_EXPORTER_OTLP_ENDPOINT at
# a gRPC port (4317) without a protocol: a switched default would send their spans to it over HTTP, and lose them.
DEFAULT_OTLP_PROTOCOL = "grpc"


def otlp_protocol() -> str:
    """The OTLP transport the environment asks for (the traces-specific variable wins); TracingSetupError for one
    pdserve lacks, since spans sent in the wrong protocol would be lost with no more than a log line."""
    for variable in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = os.environ.get(variable, "").strip()
        if protocol:
            if protocol not in OTLP_EXPORTERS:
                raise TracingSetupError(f"{variable}={protocol!r}: pdserve exports OTLP over "
                                        f"{' or '.join(OTLP_EXPORTERS)}")
            return protocol
    return DEFAULT_OTLP_PROTOCOL


def _exporter(name: str):
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        return ConsoleSpanExporter()
    if name != "otlp":
        raise TracingSetupError(f"OTEL_TRACES_EXPORTER={name!r}: pdserve exports traces with otlp, console or none")
    # The exporter reads its own endpoint, headers, TLS and timeout variables; over http/protobuf it appends
    # /v1/traces to OTEL_EXPORTER_OTLP_ENDPOINT and takes OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as it is.
    module = importlib.import_module(OTLP_EXPORTERS[otlp_protocol()])
    try:
        return module.OTLPSpanExporter()
    except ValueError as exc:  # e.g. a malformed OTEL_EXPORTER_OTLP_* value
        raise TracingSetupError(f"OTLP exporter settings: {exc}") from None


def install(provider) -> None:
    """Trace through `provider` (an SDK TracerProvider); tests pass one with an in-memory exporter."""
    global _provider, _tracer
    _provider, _tracer = provider, provider.get_tracer(TRACER_NAME)


def shutdown() -> None:
    """Flush and stop the exporters (at process exit, so the last requests' spans are not lost)."""
    global _provider, _tracer
    provider, _provider, _tracer = _provider, None, trace.NoOpTracer()
    if provider is not None:
        # Bounded: an unreachable collector must not hold up a stopping process for the exporter's own timeouts.
        provider.force_flush(timeout_millis=SHUTDOWN_FLUSH_MS)
        provider.shutdown()


def context_from_traceparent(traceparent: str) -> Context | None:
    """The remote parent a W3C `traceparent` names (None when empty or unparsable)."""
    return context_from_headers({"traceparent": traceparent}) if traceparent else None


def context_from_headers(headers) -> Context | None:
    """The client's trace from its `traceparent` / `tracestate` headers, if it sent a valid one."""
    ctx = _PROPAGATOR.extract(headers)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def traceparent_of(span: Span | None) -> str:
    """`span`'s W3C traceparent, to hand to a worker ("" for no span)."""
    if span is None:
        return ""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def child_context(span: Span | None) -> Context | None:
    return None if span is None else trace.set_span_in_context(span)


class WallClock:
    """Turns readings of `clock` (monotonic or perf_counter seconds) into the wall-clock nanoseconds spans carry,
    from one pair of readings: spans converted by one WallClock keep their exact durations and order, however
    long this thread waited between reading the two clocks."""

    def __init__(self, clock=time.monotonic):
        self._wall_ns = time.time_ns()
        self._clock = clock()

    def ns(self, stamp: float) -> int:
        return self._wall_ns - int((self._clock - stamp) * 1e9)


def record_span(name: str, start: float, end: float, parent: Context | None, clock: WallClock | None = None,
                kind: SpanKind = SpanKind.INTERNAL, attributes: dict | None = None) -> Span:
    """A finished span for a phase timed from `start` to `end` (readings of `clock`'s clock; time.monotonic
    by default)."""
    clock = clock or WallClock()
    span = tracer().start_span(name, context=parent, kind=kind, start_time=clock.ns(start), attributes=attributes)
    span.end(end_time=clock.ns(end))
    return span
