"""A worker's role switch in place (`WorkerControl.SwitchRole`), as SGLang's `/pd_role_switch` does it.

Life of a switch:
  1. The call names the new role and the longest drain. It is refused (FAILED_PRECONDITION) while the worker
     is already draining or switching, and (INVALID_ARGUMENT) for its own role or a drain out of range.
  2. The worker's serving round stops as on SIGTERM: probes see NOT_SERVING, the worker deregisters from the
     coordinator (so nothing more is routed to the old role), and only then does the call answer.
  3. It drains up to the call's `drain_timeout_s`: a prefill worker finishes its queue, a decode worker its
     streams; streams still running then are cut and the coordinator migrates them to another decode worker.
  4. The round ends (gRPC server, token channels, KV event log, engine); the next one builds the new role's engine
     around the model already loaded, binds the same gRPC port and registers in the new role, with a new KV
     event epoch, so every coordinator forgets the old role's blocks.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from worker.service.drain import DrainGate
from worker.service.options import ROLES

logger = logging.getLogger(__name__)

MAX_DRAIN_S = 3600.0


class RoleSwitch:
    """One serving round's stop request: a signal (stop the worker) or a switch (serve again in `next_role`)."""

    def __init__(self, role: str, drain_timeout_s: float):
        self.role = role
        self.next_role: str | None = None
        self.drain_timeout_s = drain_timeout_s
        self.stop = asyncio.Event()
        self.deregistered = asyncio.Event()

    def request(self, role: str, drain_timeout_s: float) -> None:
        self.next_role, self.drain_timeout_s = role, drain_timeout_s
        self.stop.set()


class WorkerControlServicer(pb_grpc.WorkerControlServicer):
    """Takes SwitchRole calls for the round it serves."""

    def __init__(self, switch: RoleSwitch, gate: DrainGate):
        self.switch = switch
        self.gate = gate

    async def SwitchRole(self, request: pb.SwitchRoleRequest, context: grpc.aio.ServicerContext):
        switch = self.switch
        if request.role not in ROLES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"role must be 'prefill' or 'decode', got {request.role!r}")
        if request.role == switch.role:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"this worker is a {switch.role} worker already")
        if switch.role not in ROLES:  # an encode worker loaded the vision tower alone
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"a {switch.role} worker holds no language model: it cannot switch roles")
        if not 0 <= request.drain_timeout_s <= MAX_DRAIN_S:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"drain_timeout_s must be in [0, {MAX_DRAIN_S:g}], got {request.drain_timeout_s}")
        if switch.stop.is_set() or self.gate.draining:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this worker is draining or switching already")
        in_flight = self.gate.in_flight
        logger.info("switching from %s to %s: %d requests in flight, drain up to %gs", switch.role, request.role,
                    in_flight, request.drain_timeout_s)
        switch.request(request.role, request.drain_timeout_s)
        await switch.deregistered.wait()  # the answer means: no coordinator routes the old role here any more
        return pb.SwitchRoleResponse(previous_role=switch.role, role=request.role, in_flight=in_flight)
