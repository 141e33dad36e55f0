"""A vLLM instance's answers and broken calls as the WorkerCallError a pdserve worker's failure would be (failures.py
then classifies them): no connection or a reset is UNAVAILABLE, a 400 INVALID_ARGUMENT, a 5xx INTERNAL, the call's
deadline DEADLINE_EXCEEDED."""

from __future__ import annotations

import json

from coordinator.requests.failures import CALL_DEADLINE_DETAILS, WorkerCallError, WorkerFailure
from coordinator.workers.vllm.http1 import LostInstance
from proto import worker_pb2 as pb


def failure(stage: str, address: str, code: str, details: str, reason: int = 0) -> WorkerCallError:
    return WorkerCallError(WorkerFailure(stage, address, code, details, reason))


def call_failure(stage: str, address: str, error: BaseException) -> WorkerCallError:
    """What a call that ended with `error` tells the attempt, as a pdserve worker's failure would."""
    if isinstance(error, WorkerCallError):
        return error
    if isinstance(error, TimeoutError):
        return failure(stage, address, "DEADLINE_EXCEEDED", CALL_DEADLINE_DETAILS, pb.FAILURE_REASON_CALL_DEADLINE)
    if isinstance(error, LostInstance):
        return failure(stage, address, "UNAVAILABLE", str(error))
    if isinstance(error, OSError):  # refused, reset, closed, no route
        return failure(stage, address, "UNAVAILABLE", f"{type(error).__name__}: {error}")
    return failure(stage, address, "INTERNAL", f"{type(error).__name__}: {error}")


def status_error(stage: str, address: str, status: int, text: str) -> WorkerCallError:
    """A vLLM error answer as the failure a pdserve worker's status would be."""
    try:
        message = json.loads(text).get("error", {}).get("message") or text
    except (ValueError, AttributeError):
        message = text
    message = f"HTTP {status}: {message[:500]}"
    if status == 400 or status == 422:
        return failure(stage, address, "INVALID_ARGUMENT", message)
    if status in (429, 503):  # overloaded or shutting down: another instance may take it
        return failure(stage, address, "UNAVAILABLE", message)
    return failure(stage, address, "INTERNAL", message)
