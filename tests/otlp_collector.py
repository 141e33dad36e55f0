"""An OTLP trace collector in the test process: a real gRPC TraceService on a free 127.0.0.1 port that keeps
every span it is sent, for tests that read the traces pdserve processes export (OTLP over HTTP: otlp_http_collector)."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tpb_grpc

from tests.helpers import wait_for


@dataclass(frozen=True)
class CollectedSpan:
    """One exported span, flattened: ids as hex, times in ns, attributes as plain values."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    kind: int
    status_code: int
    attributes: dict

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class CollectedSpans:
    """The spans of every ExportTraceServiceRequest a collector was sent, whatever the transport."""

    def __init__(self):
        self.spans: list[CollectedSpan] = []
        self._lock = threading.Lock()

    def keep(self, request: tpb.ExportTraceServiceRequest) -> None:
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    for s in scope.spans:
                        self.spans.append(CollectedSpan(
                            resource.get("service.name", ""), s.name, s.trace_id.hex(), s.span_id.hex(),
                            s.parent_span_id.hex(), s.start_time_unix_nano, s.end_time_unix_nano, s.kind,
                            s.status.code, {a.key: _value(a.value) for a in s.attributes}))

    def trace(self, trace_id: str) -> list[CollectedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, predicate, timeout_s: float = 10.0) -> list[CollectedSpan]:
        """The spans once `predicate(spans)` holds; AssertionError with what came if it never does."""
        def matched() -> list[CollectedSpan] | None:
            with self._lock:
                spans = list(self.spans)
            return spans if predicate(spans) else None

        try:
            return wait_for(matched, timeout_s, "spans")
        except AssertionError:
            raise AssertionError("spans never matched; got:\n" + "\n".join(
                f"{s.service} {s.name} {s.trace_id[:8]} {s.span_id[:8]}<-{s.parent_span_id[:8]}"
                for s in self.spans)) from None


class OtlpCollector(CollectedSpans, tpb_grpc.TraceServiceServicer):
    """OTLP over gRPC: keeps the spans of every Export call; `env()` points a pdserve process at it."""

    def __init__(self):
        super().__init__()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        tpb_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def Export(self, request: tpb.ExportTraceServiceRequest, context) -> tpb.ExportTraceServiceResponse:
        self.keep(request)
        return tpb.ExportTraceServiceResponse()

    def env(self) -> dict[str, str]:
        """The standard OTEL_* settings that make a process export here, batched every 100 ms. No protocol is
        named: the tests using it also check that grpc is pdserve's default."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.port}", "OTEL_BSP_SCHEDULE_DELAY": "100"}

    def stop(self) -> None:
        self._server.stop(grace=None)
