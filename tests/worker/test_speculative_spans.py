"""A drafting request's decode span carries its acceptance (mean acceptance length, drafts, accepted tokens)."""

from __future__ import annotations

import time

import pytest

from worker.engine.speculative.drafter import DraftState
from worker.engine.speculative.proposers import TokenHistory
from worker.service.request_spans import DecodeTimes, record_decode, traced


def record(drafts) -> None:
    parent = traced("00-" + "1" * 32 + "-" + "2" * 16 + "-01")
    record_decode(parent, "r1", 9, False, DecodeTimes(time.perf_counter(), generated=12, drafts=drafts), None)


def test_a_drafted_requests_decode_span_carries_its_mean_acceptance_length(span_exporter):
    state = DraftState(TokenHistory(), [], drafts=4, draft_tokens=20, accepted=10)
    record(state)
    span = next(s for s in span_exporter.get_finished_spans() if s.name == "decode")
    assert span.attributes["pdserve.spec.mean_acceptance_length"] == pytest.approx(3.5)
    assert (span.attributes["pdserve.spec.drafts"], span.attributes["pdserve.spec.draft_tokens"],
            span.attributes["pdserve.spec.accepted_tokens"]) == (4, 20, 10)


def test_a_request_that_never_drafted_has_no_speculative_attributes(span_exporter):
    record(None)
    span = next(s for s in span_exporter.get_finished_spans() if s.name == "decode")
    assert not any(key.startswith("pdserve.spec.") for key in span.attributes)
