"""Worker failures are classified as documented in coordinator/failures.py, without any server."""

from __future__ import annotations

import pytest

from coordinator.failures import FailureKind, WorkerFailure, classify
from kv_transfer.base import KV_SEND_FAILED

K = FailureKind


@pytest.mark.parametrize(("stage", "code", "details", "kind", "blamed"), [
    ("decode", "RESOURCE_EXHAUSTED", "prompt + max_tokens exceed the KV budget", K.REQUEST_FAULT, None),
    ("prefill", "INVALID_ARGUMENT", "bad sampling", K.REQUEST_FAULT, None),
    ("decode", "ALREADY_EXISTS", "duplicate request id", K.REQUEST_FAULT, None),
    ("prefill", "OUT_OF_RANGE", "token id", K.REQUEST_FAULT, None),
    ("decode", "DEADLINE_EXCEEDED", "Deadline Exceeded", K.DEADLINE, None),
    ("decode", "UNAVAILABLE", "failed to connect", K.WORKER_GONE, "decode"),
    ("decode", "CANCELLED", "", K.WORKER_GONE, "decode"),
    ("prefill", "UNKNOWN", "", K.WORKER_GONE, "prefill"),
    ("prefill", "INTERNAL", "", K.WORKER_GONE, "prefill"),
    ("prefill", "UNAVAILABLE", f"{KV_SEND_FAILED} d:1: connection reset", K.KV_SEND_FAILED, "decode"),
    ("decode", "DATA_LOSS", "checksum mismatch", K.KV_NOT_RECEIVED, "prefill"),
    ("decode", "DEADLINE_EXCEEDED", "KV cache did not arrive within 5s", K.KV_NOT_RECEIVED, "prefill"),
    ("prefill", "DEADLINE_EXCEEDED", "Deadline Exceeded", K.WORKER_FAULT, "prefill"),
    ("prefill", "FAILED_PRECONDITION", "draining", K.WORKER_FAULT, "prefill"),
])
def test_each_failure_is_classified_and_blames_the_instance_at_fault(stage, code, details, kind, blamed):
    assert classify(stage, code, details) is kind
    assert kind.blamed_role(stage) == blamed
    assert kind.opens_circuit == (kind is K.WORKER_GONE)


def test_a_request_fault_takes_precedence_over_the_kv_send_marker():
    assert classify("prefill", "RESOURCE_EXHAUSTED", f"{KV_SEND_FAILED} d:1") is K.REQUEST_FAULT


def test_a_worker_that_refuses_the_request_is_a_client_error():
    error = WorkerFailure("decode", "d:1", "RESOURCE_EXHAUSTED", "needs 5000 KV tokens").error()
    assert error.status == 400
    assert error.message == "decode worker d:1 refused the request: needs 5000 KV tokens"


@pytest.mark.parametrize(("code", "status"), [("UNAVAILABLE", 503), ("DATA_LOSS", 503), ("DEADLINE_EXCEEDED", 504)])
def test_other_failures_name_the_worker_and_the_status_code(code, status):
    error = WorkerFailure("prefill", "p:1", code, "boom").error()
    assert error.status == status
    assert error.message == f"prefill worker p:1 failed: {code}: boom"


def test_the_circuit_breaker_reason_says_what_went_wrong():
    assert WorkerFailure("decode", "d:1", "UNAVAILABLE", "gone").circuit_reason == "UNAVAILABLE: gone"
    assert WorkerFailure("decode", "d:1", "DATA_LOSS", "bad block").circuit_reason == "KV transfer failed: bad block"
    sent = f"{KV_SEND_FAILED} d:1: reset"
    assert WorkerFailure("prefill", "p:1", "UNAVAILABLE", sent).circuit_reason == sent
