"""Worker failures are classified as documented in coordinator/requests/failures.py, from the status code and the
worker's FailureReason, never from the message; without any server."""

from __future__ import annotations

import pytest

from coordinator.requests.failures import FailureKind, WorkerFailure, classify
from proto import worker_pb2 as pb

K = FailureKind
NONE = pb.FAILURE_REASON_UNSPECIFIED


@pytest.mark.parametrize(("stage", "code", "reason", "kind", "blamed"), [
    ("decode", "RESOURCE_EXHAUSTED", NONE, K.REQUEST_FAULT, None),
    ("prefill", "INVALID_ARGUMENT", NONE, K.REQUEST_FAULT, None),
    ("decode", "ALREADY_EXISTS", NONE, K.REQUEST_FAULT, None),
    ("prefill", "OUT_OF_RANGE", NONE, K.REQUEST_FAULT, None),
    ("decode", "DEADLINE_EXCEEDED", pb.FAILURE_REASON_CALL_DEADLINE, K.DEADLINE, None),
    ("decode", "DEADLINE_EXCEEDED", NONE, K.DEADLINE, None),  # a gRPC call's own deadline gives no reason
    ("decode", "UNAVAILABLE", NONE, K.WORKER_GONE, "decode"),
    ("decode", "CANCELLED", NONE, K.WORKER_GONE, "decode"),
    ("prefill", "UNKNOWN", NONE, K.WORKER_GONE, "prefill"),
    ("prefill", "INTERNAL", NONE, K.WORKER_GONE, "prefill"),
    ("prefill", "UNAVAILABLE", pb.FAILURE_REASON_KV_SEND_FAILED, K.KV_SEND_FAILED, "decode"),
    ("decode", "DATA_LOSS", pb.FAILURE_REASON_KV_CORRUPT, K.KV_NOT_RECEIVED, "prefill"),
    ("decode", "DATA_LOSS", NONE, K.KV_NOT_RECEIVED, "prefill"),
    ("decode", "DEADLINE_EXCEEDED", pb.FAILURE_REASON_KV_NOT_RECEIVED, K.KV_NOT_RECEIVED, "prefill"),
    ("prefill", "DEADLINE_EXCEEDED", pb.FAILURE_REASON_CALL_DEADLINE, K.WORKER_FAULT, "prefill"),
    ("prefill", "DEADLINE_EXCEEDED", pb.FAILURE_REASON_KV_LEASE_EXPIRED, K.WORKER_FAULT, "prefill"),
    ("prefill", "DEADLINE_EXCEEDED", NONE, K.WORKER_FAULT, "prefill"),
    ("prefill", "UNAVAILABLE", pb.FAILURE_REASON_DRAINING, K.WORKER_GONE, "prefill"),
    ("decode", "UNAVAILABLE", pb.FAILURE_REASON_DRAINING, K.WORKER_GONE, "decode"),
    ("prefill", "FAILED_PRECONDITION", NONE, K.WORKER_FAULT, "prefill"),
])
def test_each_failure_is_classified_and_blames_the_instance_at_fault(stage, code, reason, kind, blamed):
    assert classify(stage, code, reason) is kind
    assert kind.blamed_role(stage) == blamed
    assert kind.opens_circuit == (kind is K.WORKER_GONE)


@pytest.mark.parametrize("details", ["", "Deadline Exceeded", "sending KV to decode worker d:1: reset",
                                     "KV cache did not arrive within 5s", "anything at all"])
@pytest.mark.parametrize(("stage", "code", "reason", "kind"), [
    ("decode", "DEADLINE_EXCEEDED", pb.FAILURE_REASON_KV_NOT_RECEIVED, K.KV_NOT_RECEIVED),
    ("decode", "DEADLINE_EXCEEDED", pb.FAILURE_REASON_CALL_DEADLINE, K.DEADLINE),
    ("prefill", "UNAVAILABLE", pb.FAILURE_REASON_KV_SEND_FAILED, K.KV_SEND_FAILED),
    ("prefill", "UNAVAILABLE", NONE, K.WORKER_GONE),
])
def test_the_message_never_changes_the_kind(stage, code, reason, kind, details):
    assert WorkerFailure(stage, "w:1", code, details, reason).kind is kind


def test_a_reason_given_at_the_other_stage_leaves_the_status_code_to_decide():
    assert classify("decode", "UNAVAILABLE", pb.FAILURE_REASON_KV_SEND_FAILED) is K.WORKER_GONE
    assert classify("prefill", "DATA_LOSS", pb.FAILURE_REASON_KV_CORRUPT) is K.WORKER_FAULT


def test_a_request_fault_takes_precedence_over_any_reason():
    assert classify("prefill", "RESOURCE_EXHAUSTED", pb.FAILURE_REASON_KV_SEND_FAILED) is K.REQUEST_FAULT


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
    corrupt = WorkerFailure("decode", "d:1", "DATA_LOSS", "bad block", pb.FAILURE_REASON_KV_CORRUPT)
    assert corrupt.circuit_reason == "KV transfer failed: bad block"
    sent = "sending KV to decode worker d:1: reset"
    assert WorkerFailure("prefill", "p:1", "UNAVAILABLE", sent, pb.FAILURE_REASON_KV_SEND_FAILED).circuit_reason == sent


@pytest.mark.parametrize("code", ["FAILED_PRECONDITION", "UNAVAILABLE", "NOT_FOUND"])
def test_embeddings_unavailable_on_a_prefill_call_is_embeddings_lost_and_blames_nobody(code):
    kind = classify("prefill", code, pb.FAILURE_REASON_EMBEDDINGS_UNAVAILABLE)
    assert kind is K.EMBEDDINGS_LOST
    assert kind.blamed_role("prefill") is None and not kind.opens_circuit


def test_embeddings_unavailable_on_a_decode_call_leaves_the_status_code_to_decide():
    assert classify("decode", "FAILED_PRECONDITION", pb.FAILURE_REASON_EMBEDDINGS_UNAVAILABLE) is K.KV_NOT_RECEIVED
    assert classify("decode", "UNAVAILABLE", pb.FAILURE_REASON_EMBEDDINGS_UNAVAILABLE) is K.WORKER_GONE
    assert K.KV_NOT_RECEIVED.blamed_role("decode") == "prefill"


def test_a_request_fault_takes_precedence_over_embeddings_unavailable():
    assert classify("prefill", "INVALID_ARGUMENT", pb.FAILURE_REASON_EMBEDDINGS_UNAVAILABLE) is K.REQUEST_FAULT
