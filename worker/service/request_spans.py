"""A worker's spans of one request, joined to the coordinator's trace by the request's `traceparent`.

Recorded when the request ends, from the times the servicer noted on time.perf_counter, and only when tracing is
on (`telemetry/tracing.py`) and the coordinator sent a trace context. A failure to record is logged, never the
request's.

Prefill worker:  prefill (server) > prefill_queue, prefill_forward,
                 kv_transfer (send side: bytes, transport, until the ack; it overlaps the forward, which hands each
                 layer's KV over as it is made)
Decode worker:   decode (server) > decode_admission, kv_transfer (receive side: header to last block),
                 first_step (the cache here, or a local prefill queued, until the first decoded token)
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import SpanKind, Status, StatusCode

from kv_transfer.base import KvReceipt
from worker.engine.messages import PrefillDone
from telemetry import tracing

logger = logging.getLogger(__name__)
_CLOCK = time.perf_counter  # what the servicers note their times on


def failure_text(exc: BaseException, context) -> str:
    """How a request's span says it ended badly: the status it was aborted with, or the exception."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "cancelled"
    details = context.details() if hasattr(context, "details") else None
    return details or str(exc) or type(exc).__name__


def record_safely(record, *args) -> None:
    """Record a request's spans from a `finally`: an error here must not replace the request's own outcome."""
    try:
        record(*args)
    except Exception:  # noqa: BLE001
        logger.exception("recording a request's spans failed")


def traced(traceparent: str):
    """The coordinator's context to record a request's spans under; None when there is nothing to record."""
    return tracing.context_from_traceparent(traceparent) if tracing.enabled() else None


class _Spans:
    """One request's spans, placed on the wall clock from one pair of readings."""

    def __init__(self):
        self.clock = tracing.WallClock(_CLOCK)
        self.end = _CLOCK()

    def server(self, name: str, start: float, parent, attributes: dict, error: str | None):
        span = tracing.tracer().start_span(name, context=parent, kind=SpanKind.SERVER,
                                           start_time=self.clock.ns(start), attributes=attributes)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self.clock.ns(self.end))
        return tracing.child_context(span)

    def child(self, name: str, start: float, end: float, parent, attributes: dict | None = None) -> None:
        tracing.record_span(name, start, end, parent, clock=self.clock, attributes=attributes)


@dataclass
class PrefillTimes:
    """What a prefill request went through, on time.perf_counter (0.0: never reached)."""

    received: float
    submitted: float = 0.0  # to the engine's prefill queue
    forward: PrefillDone | None = None  # the engine's answer: the forward's time and end
    send_started: float = 0.0
    send_ended: float = 0.0
    kv_bytes: int = 0
    transport: str = ""


def record_prefill(parent, request_id: str, prompt_tokens: int, times: PrefillTimes, error: str | None) -> None:
    spans = _Spans()
    end = spans.end
    root = spans.server("prefill", times.received, parent,
                        {"pdserve.request_id": request_id, "pdserve.prompt_tokens": prompt_tokens}, error)
    done = times.forward
    if done is not None and done.done_at:
        forward_started = done.done_at - done.forward_ms / 1000
        spans.child("prefill_queue", times.submitted, forward_started, root)
        spans.child("prefill_forward", forward_started, done.done_at, root)
    if times.send_started:
        spans.child("kv_transfer", times.send_started, times.send_ended or end, root, {
            "pdserve.kv.side": "send", "pdserve.kv.transport": times.transport, "pdserve.kv.bytes": times.kv_bytes,
            "pdserve.kv.duration_ms": ((times.send_ended or end) - times.send_started) * 1000})


@dataclass
class DecodeTimes:
    """What a decode request went through, on time.perf_counter (0.0: never reached)."""

    received: float
    admitted: float = 0.0
    cache_ready: float = 0.0  # its KV cache arrived, or its local prefill was queued
    first_step_at: float = 0.0  # its first decoded token was handed over
    receipt: KvReceipt | None = None  # how its KV cache came (None: prefilled here)
    generated: int = 0
    drafts: Any = None  # its speculative drafting (a DraftState), if it drafted


def record_decode(parent, request_id: str, prompt_len: int, local_prefill: bool, times: DecodeTimes,
                  error: str | None) -> None:
    spans = _Spans()
    root = spans.server("decode", times.received, parent, {
        "pdserve.request_id": request_id, "pdserve.prompt_tokens": prompt_len,
        "pdserve.local_prefill": local_prefill, "pdserve.generated_tokens": times.generated,
        **_speculative_attributes(times.drafts)}, error)
    if times.admitted:
        spans.child("decode_admission", times.received, times.admitted, root)
    receipt = times.receipt
    if receipt is not None and times.cache_ready:
        spans.child("kv_transfer", times.cache_ready - receipt.receive_ms / 1000, times.cache_ready, root, {
            "pdserve.kv.side": "receive", "pdserve.kv.transport": receipt.transport,
            "pdserve.kv.bytes": receipt.num_bytes, "pdserve.kv.duration_ms": receipt.receive_ms})
    if times.cache_ready and times.first_step_at:
        spans.child("first_step", times.cache_ready, times.first_step_at, root)


def _speculative_attributes(drafts) -> dict:
    """A drafted request's acceptance, as vLLM reports it: mean tokens per verified step, drafts, accepted tokens."""
    if drafts is None or not drafts.drafts:
        return {}
    return {"pdserve.spec.drafts": drafts.drafts, "pdserve.spec.draft_tokens": drafts.draft_tokens,
            "pdserve.spec.accepted_tokens": drafts.accepted,
            "pdserve.spec.mean_acceptance_length": drafts.mean_acceptance_length}
