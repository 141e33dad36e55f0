"""What a failed worker call means for the request: retry elsewhere or not, and whom to blame.

  kind             when                                                  retry  blames          circuit
  REQUEST_FAULT    RESOURCE_EXHAUSTED, INVALID_ARGUMENT, ALREADY_EXISTS,  no     nobody          -
                   OUT_OF_RANGE, from either worker
  DEADLINE         the decode call's own gRPC deadline (the request's)    no     nobody          -
  WORKER_GONE      UNAVAILABLE, CANCELLED, UNKNOWN, INTERNAL              yes    the caller      opens at once
  KV_SEND_FAILED   prefill ran but could not hand the KV cache over       yes    decode          counts
  KV_NOT_RECEIVED  any other decode failure: its KV cache arrived corrupt  yes    prefill         counts
                   (DATA_LOSS) or never (its receive timeout)
  WORKER_FAULT     any other prefill failure (its first_token_timeout)    yes    prefill         counts
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from coordinator.errors import WorkerError
from kv_transfer.base import KV_SEND_FAILED

# Codes that say the request itself is wrong: retrying elsewhere cannot help.
REQUEST_FAULT_CODES = frozenset({"RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "ALREADY_EXISTS", "OUT_OF_RANGE"})
# Codes that say the worker process is gone (killed, restarted, network cut).
GONE_CODES = frozenset({"UNAVAILABLE", "CANCELLED", "UNKNOWN", "INTERNAL"})
# gRPC's own text when a call's deadline passes, as opposed to a worker aborting with DEADLINE_EXCEEDED.
CALL_DEADLINE_DETAILS = "Deadline Exceeded"


class FailureKind(enum.Enum):
    """A classified worker failure; see the module docstring's table."""

    REQUEST_FAULT = "request_fault"
    DEADLINE = "deadline"
    WORKER_GONE = "worker_gone"
    KV_SEND_FAILED = "kv_send_failed"
    KV_NOT_RECEIVED = "kv_not_received"
    WORKER_FAULT = "worker_fault"

    def blamed_role(self, stage: str) -> str | None:
        """The role of the instance at fault when `stage` ("prefill" or "decode") failed; None: nobody."""
        if self in (FailureKind.REQUEST_FAULT, FailureKind.DEADLINE):
            return None
        if self is FailureKind.KV_SEND_FAILED:
            return "decode"
        if self is FailureKind.KV_NOT_RECEIVED:
            return "prefill"
        return stage

    @property
    def opens_circuit(self) -> bool:
        """A worker that is gone is taken out at once, not after `failure_threshold` failures."""
        return self is FailureKind.WORKER_GONE


def classify(stage: str, code: str, details: str) -> FailureKind:
    """The kind of failure of a `stage` call that ended with gRPC status `code` (its name) and `details`."""
    if code in REQUEST_FAULT_CODES:
        return FailureKind.REQUEST_FAULT
    if stage == "decode":
        if code == "DEADLINE_EXCEEDED" and CALL_DEADLINE_DETAILS in details:
            return FailureKind.DEADLINE
        # The decode worker is fine but its KV cache arrived corrupt or never arrived: the prefill
        # side failed, so another prefill instance may do better.
        return FailureKind.WORKER_GONE if code in GONE_CODES else FailureKind.KV_NOT_RECEIVED
    if details.startswith(KV_SEND_FAILED):
        return FailureKind.KV_SEND_FAILED
    return FailureKind.WORKER_GONE if code in GONE_CODES else FailureKind.WORKER_FAULT


@dataclass(frozen=True)
class WorkerFailure:
    """A worker call that ended in an error status: which call, where, and what the worker said."""

    stage: str  # "prefill" or "decode"
    address: str
    code: str  # the gRPC status code's name, e.g. "UNAVAILABLE"
    details: str

    @property
    def kind(self) -> FailureKind:
        return classify(self.stage, self.code, self.details)

    @property
    def circuit_reason(self) -> str:
        """Why the blamed instance's circuit breaker counts this failure, as /v1/instances shows it."""
        kind = self.kind
        if kind is FailureKind.KV_SEND_FAILED:
            return self.details
        if kind is FailureKind.KV_NOT_RECEIVED:
            return f"KV transfer failed: {self.details}"
        return f"{self.code}: {self.details}"

    def error(self) -> WorkerError:
        """What the client is told when this failure ends the request."""
        if self.code in ("RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"):
            # The worker says this request can never fit its KV budget, or asks what its backend cannot
            # do (guided decoding on a simulated worker): the client must ask for something else.
            return WorkerError(f"{self.stage} worker {self.address} refused the request: {self.details}", status=400)
        status = 504 if self.code == "DEADLINE_EXCEEDED" else 503
        return WorkerError(f"{self.stage} worker {self.address} failed: {self.code}: {self.details}", status=status)


class WorkerCallError(Exception):
    """A prefill, decode or health call failed; raised by WorkerClient instead of gRPC's own error."""

    def __init__(self, failure: WorkerFailure):
        super().__init__(f"{failure.stage} worker {failure.address}: {failure.code}: {failure.details}")
        self.failure = failure


def deadline_error(timeout: float) -> WorkerError:
    """The request's own deadline (its timeout or infer_timeout) passed."""
    return WorkerError(f"request exceeded its deadline of {timeout}s and was cancelled", status=504)
