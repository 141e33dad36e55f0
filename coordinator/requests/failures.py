"""What a failed worker call means for the request: retry elsewhere or not, and whom to blame.

Classified from the call's status code and the FailureReason the worker gave with it (worker.proto), never from
its message. A failure without a reason (from a worker before FailureReason, or a call whose own gRPC deadline
passed) is classified by its status code alone.

  kind             when                                                   retry  blames      circuit
  REQUEST_FAULT    RESOURCE_EXHAUSTED, INVALID_ARGUMENT, ALREADY_EXISTS,   no     nobody      -
                   OUT_OF_RANGE, from either worker, whatever the reason
  DEADLINE         decode: CALL_DEADLINE (the request's own deadline), or  no     nobody      -
                   DEADLINE_EXCEEDED without a reason
  KV_SEND_FAILED   prefill: KV_SEND_FAILED (ran, but could not hand the    yes    decode      counts
                   KV cache over)
  KV_NOT_RECEIVED  decode: KV_NOT_RECEIVED, KV_CORRUPT; without a reason,  yes    prefill     counts
                   any other code than those above and below
  WORKER_GONE      DRAINING; without a reason, UNAVAILABLE, CANCELLED,     yes    the caller  opens at once
                   UNKNOWN, INTERNAL
  WORKER_FAULT     prefill: CALL_DEADLINE (its first_token_timeout),       yes    prefill     counts
                   KV_LEASE_EXPIRED; without a reason, any other code
  MOVED            decode: PREEMPTED (it cannot recompute the sequence)    yes    nobody      -
                   (the request moves off that decode instance all the same)
  ELSEWHERE        LORA_UNAVAILABLE (that worker cannot load the request's  yes    nobody      -
                   adapter: no adapters there, its folder missing or
                   changed there), either stage (the request moves off
                   that instance; the worker serves other requests)
  EMBEDDINGS_LOST  prefill: EMBEDDINGS_UNAVAILABLE (an image's encoder     yes    nobody      -
                   output could not be pulled from its encode worker):
                   at once with the files, on the same instances, not
                   counted as a retry
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from coordinator.errors import WorkerError
from proto import worker_pb2 as pb

# Codes that say the request itself is wrong: retrying elsewhere cannot help.
REQUEST_FAULT_CODES = frozenset({"RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "ALREADY_EXISTS", "OUT_OF_RANGE"})
# Codes that say the worker process is gone (killed, restarted, network cut).
GONE_CODES = frozenset({"UNAVAILABLE", "CANCELLED", "UNKNOWN", "INTERNAL"})
# gRPC's own words for a call whose deadline passed: the coordinator's own clocks end a channel request with them.
CALL_DEADLINE_DETAILS = "Deadline Exceeded"


class FailureKind(enum.Enum):
    """A classified worker failure; see the module docstring's table."""

    REQUEST_FAULT = "request_fault"
    DEADLINE = "deadline"
    WORKER_GONE = "worker_gone"
    KV_SEND_FAILED = "kv_send_failed"
    KV_NOT_RECEIVED = "kv_not_received"
    WORKER_FAULT = "worker_fault"
    MOVED = "moved"
    ELSEWHERE = "elsewhere"
    EMBEDDINGS_LOST = "embeddings_lost"

    def blamed_role(self, stage: str) -> str | None:
        """The role of the instance at fault when `stage` ("prefill", "decode" or "encode") failed; None: nobody."""
        if self in (FailureKind.REQUEST_FAULT, FailureKind.DEADLINE, FailureKind.MOVED, FailureKind.ELSEWHERE,
                    FailureKind.EMBEDDINGS_LOST):
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


# The kind each (stage, reason) means; a reason given at another stage leaves the status code to decide.
_KIND_OF_REASON = {
    ("decode", pb.FAILURE_REASON_CALL_DEADLINE): FailureKind.DEADLINE,
    ("decode", pb.FAILURE_REASON_KV_NOT_RECEIVED): FailureKind.KV_NOT_RECEIVED,
    ("decode", pb.FAILURE_REASON_KV_CORRUPT): FailureKind.KV_NOT_RECEIVED,
    ("decode", pb.FAILURE_REASON_DRAINING): FailureKind.WORKER_GONE,
    ("decode", pb.FAILURE_REASON_PREEMPTED): FailureKind.MOVED,
    ("prefill", pb.FAILURE_REASON_CALL_DEADLINE): FailureKind.WORKER_FAULT,
    ("prefill", pb.FAILURE_REASON_KV_SEND_FAILED): FailureKind.KV_SEND_FAILED,
    ("prefill", pb.FAILURE_REASON_KV_LEASE_EXPIRED): FailureKind.WORKER_FAULT,
    ("prefill", pb.FAILURE_REASON_DRAINING): FailureKind.WORKER_GONE,
    ("decode", pb.FAILURE_REASON_LORA_UNAVAILABLE): FailureKind.ELSEWHERE,
    ("prefill", pb.FAILURE_REASON_LORA_UNAVAILABLE): FailureKind.ELSEWHERE,
    ("prefill", pb.FAILURE_REASON_EMBEDDINGS_UNAVAILABLE): FailureKind.EMBEDDINGS_LOST,
}


def classify(stage: str, code: str, reason: int = pb.FAILURE_REASON_UNSPECIFIED) -> FailureKind:
    """The kind of failure of a `stage` call that ended with gRPC status `code` (its name) and FailureReason
    `reason`."""
    if code in REQUEST_FAULT_CODES:
        return FailureKind.REQUEST_FAULT
    kind = _KIND_OF_REASON.get((stage, reason))
    if kind is not None:
        return kind
    if code in GONE_CODES:
        return FailureKind.WORKER_GONE
    if stage == "decode":
        # No reason: DEADLINE_EXCEEDED is the call's own deadline (an older worker's KV timeout looks the same);
        # any other code says the KV cache arrived corrupt or never, so another prefill instance may do better.
        return FailureKind.DEADLINE if code == "DEADLINE_EXCEEDED" else FailureKind.KV_NOT_RECEIVED
    return FailureKind.WORKER_FAULT


@dataclass(frozen=True)
class WorkerFailure:
    """A worker call that ended in an error status: which call, where, and what the worker said and why."""

    stage: str  # the role of the worker called: "prefill", "decode" or "encode"
    address: str
    code: str  # the gRPC status code's name, e.g. "UNAVAILABLE"
    details: str  # for people: the client's error and /v1/instances show it
    reason: int = pb.FAILURE_REASON_UNSPECIFIED  # the worker's FailureReason

    @property
    def kind(self) -> FailureKind:
        return classify(self.stage, self.code, self.reason)

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
    """A prefill, decode, encode or health call failed; raised by WorkerClient instead of gRPC's own error."""

    def __init__(self, failure: WorkerFailure):
        super().__init__(f"{failure.stage} worker {failure.address}: {failure.code}: {failure.details}")
        self.failure = failure


def deadline_error(timeout: float) -> WorkerError:
    """The request's own deadline (its timeout or infer_timeout) passed."""
    return WorkerError(f"request exceeded its deadline of {timeout}s and was cancelled", status=504)
