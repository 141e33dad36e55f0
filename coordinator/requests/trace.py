"""Where a request's time went: its phases, timed once, observed in `pdserve_request_phase_seconds{phase}`
and, when tracing is on (`telemetry/tracing.py`), recorded as spans of one trace per request.

The phases, in the order they happen:
  1. tokenize          prompt (and chat template) to token ids, in the client API's adapter (once per client
                       request, all its prompts; the other phases are per generation)
  2. queue             waiting in the coordinator's RequestQueue
  Then per attempt, under an `attempt` span (a retry or a migration is another attempt):
  3. route             the router choosing a decode and a prefill instance
  4. decode_admission  the decode stream opening until the decode worker holds KV budget (`accepted`)
  5. prefill           the Prefill call; `prefill_queue`, `prefill_forward` and `kv_transfer` are the prefill
                       worker's own figures for it (waiting for a forward, the forward, and sending the KV cache
                       until the decode worker's ack, which overlaps the forward: layers go as they are made)
  6. first_token       `accepted` until the first token reaches the coordinator (it spans 5)
  7. decode            the first token to the last
Phases 1-4, 6 and 7 follow one another: with the client's own reading and writing they make up the request's
latency. The workers' spans join the attempt's trace through the request's `traceparent`.
"""

from __future__ import annotations

import time
from contextvars import ContextVar

from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from telemetry import tracing

PHASES = ("tokenize", "queue", "route", "decode_admission", "prefill", "prefill_queue", "prefill_forward",
          "kv_transfer", "first_token", "decode", "encode")
# encode: a request's images on encode workers, from its arrival in the line until its turn waited for them too
# The phases that follow one another without overlap (prefill and its parts run inside first_token).
SEQUENTIAL_PHASES = ("tokenize", "queue", "route", "decode_admission", "first_token", "decode")


class RequestTrace:
    """One client request: its root span (a child of the client's `traceparent`, if sent) and its tokenize time."""

    def __init__(self, method: str, route: str, headers):
        self.span: Span | None = None
        if tracing.enabled():
            self.span = tracing.tracer().start_span(f"{method} {route}".rstrip(), kind=SpanKind.SERVER,
                                                    context=tracing.context_from_headers(headers))
        self.tokenize_s = 0.0

    def tokenized(self, started: float) -> None:
        now = time.monotonic()
        self.tokenize_s += now - started
        if self.span is not None:
            tracing.record_span("tokenize", started, now, tracing.child_context(self.span))

    def end(self, status: int) -> None:
        if self.span is not None:
            self.span.set_attribute("http.response.status_code", status)
            if status >= 500:
                self.span.set_status(Status(StatusCode.ERROR))
            self.span.end()


CURRENT_REQUEST: ContextVar[RequestTrace | None] = ContextVar("pdserve_request_trace", default=None)


def note_tokenized(started: float) -> None:
    """Count a tokenization that began at `started` (time.monotonic) against the request being served (the
    request gate opens a RequestTrace around every client API call)."""
    trace = CURRENT_REQUEST.get()
    if trace is not None:
        trace.tokenized(started)


class GenerationTrace:
    """One generation's way through the pipeline: its phase durations (summed over attempts, observed once at
    the end) and, when tracing, its spans under the request's root span."""

    def __init__(self, metrics):
        self.metrics = metrics
        self.durations: dict[str, float] = {}
        self.kv_bytes = 0  # KV streamed prefill -> decode, over its attempts
        request = CURRENT_REQUEST.get()
        root = request.span if request is not None else None
        self.tracing = tracing.enabled()
        self._clock = tracing.WallClock() if self.tracing else None  # one anchor: the phases keep their order
        self._root = tracing.child_context(root)
        self._attempt: Span | None = None

    def phase(self, name: str, started: float, ended: float) -> None:
        """A phase timed on time.monotonic, under the current attempt if one is running."""
        self.durations[name] = self.durations.get(name, 0.0) + (ended - started)
        if self.tracing:
            parent = tracing.child_context(self._attempt) if self._attempt is not None else self._root
            tracing.record_span(name, started, ended, parent, clock=self._clock)

    def add_time(self, name: str, seconds: float) -> None:
        """Time in a phase that has a span of its own elsewhere (the prefill call's, or a worker's)."""
        self.durations[name] = self.durations.get(name, 0.0) + seconds

    def start_attempt(self, number: int, migration: bool) -> None:
        if self.tracing:
            self._attempt = tracing.tracer().start_span("attempt", context=self._root, attributes={
                "pdserve.attempt": number, "pdserve.migration": migration})

    def attempt_traceparent(self) -> str:
        """What the decode worker's spans hang from."""
        return tracing.traceparent_of(self._attempt)

    def route_chosen(self, prefill: str | None, decode: str, prompt_tokens: int = 0, prefill_cached: int = 0,
                     decode_cached: int = 0) -> None:
        """The attempt's instances, and the prompt tokens the KV index expected each to hold."""
        if self._attempt is not None:
            self._attempt.set_attributes({
                "pdserve.decode": decode, "pdserve.prefill": prefill or "local", "pdserve.prompt_tokens": prompt_tokens,
                "pdserve.prefill.expected_cached_tokens": prefill_cached,
                "pdserve.decode.expected_cached_tokens": decode_cached})

    def end_attempt(self, error: str | None = None) -> None:
        if self._attempt is not None:
            if error is not None:
                self._attempt.set_status(Status(StatusCode.ERROR, error))
            self._attempt.end()
            self._attempt = None

    def start_prefill(self) -> Span | None:
        """The Prefill call's client span (ended by the caller); None when not tracing."""
        if self._attempt is None:
            return None
        return tracing.tracer().start_span("prefill", context=tracing.child_context(self._attempt),
                                           kind=SpanKind.CLIENT)

    def finish(self) -> None:
        """Observe every phase this generation went through, once."""
        if self.durations:
            self.metrics.phases(self.durations)
