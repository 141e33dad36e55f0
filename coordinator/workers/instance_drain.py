"""An instance drained by the coordinator (POST /v1/instances/drain), for either engine: a vLLM instance has no
drain of its own that the coordinator hears, and an operator may take any instance out before stopping it.

  1. Out of routing: the instance is held DRAINING; health checks do not bring it back until it is resumed
     (POST /v1/instances/resume) or forgotten.
  2. Its requests run to their end within `drain_timeout_s` (this coordinator's outstanding requests on it).
  3. Then the decode streams still running move (pdserve workers with rebalance_config on: as a rebalancing move,
     the prompt and the tokens sent prefilled again elsewhere); those that cannot move (and a vLLM instance's) stay,
     and run to their end there, or migrate when the instance stops (as a lost decode worker's streams do).
  4. The answer says how many ended there, how many moved, and how many are left.
A pdserve worker drains itself on SIGTERM (worker/service/lifecycle.py); this is the same order, driven from here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from coordinator.errors import ApiError
from coordinator.workers.instances import InstanceRegistry

logger = logging.getLogger(__name__)

POLL_S = 0.05  # how often the outstanding count is read while waiting (a coordinator-local number: cheap)


class DrainRequest(BaseModel):
    """Body of POST /v1/instances/drain."""

    model_config = ConfigDict(extra="forbid")

    address: str = Field(description="host:port of the instance, as GET /v1/instances lists it")
    role: Literal["prefill", "decode"] | None = Field(None, description="needed only where one address serves both")
    drain_timeout_s: float = Field(30.0, ge=0, le=3600, description="Longest wait for its requests to end before "
                                   "the decode streams still running move")


class ResumeRequest(BaseModel):
    """Body of POST /v1/instances/resume."""

    model_config = ConfigDict(extra="forbid")

    address: str
    role: Literal["prefill", "decode"] | None = None


def find_instance(registry: InstanceRegistry, address: str, role: str | None):
    """The instance at `address` (of `role`); ApiError 404 when none, 400 when the address serves both roles."""
    roles = (role,) if role else ("prefill", "decode")
    found = [i for r in roles for i in [registry.get(r, address)] if i is not None]
    if not found:
        raise ApiError(404, f"no instance at {address}" + (f" with role {role}" if role else ""))
    if len(found) > 1:
        raise ApiError(400, f"{address} serves both roles: name `role` (prefill or decode)")
    return found[0]


async def drain_instance(registry: InstanceRegistry, rebalancer, body: DrainRequest) -> dict:
    """Steps 1-4 above; `rebalancer`: the DecodeRebalancer, or None when rebalancing is off."""
    instance = find_instance(registry, body.address, body.role)
    registry.hold(instance)
    started = instance.outstanding_requests
    logger.warning("draining %s instance %s: %d requests on it, up to %gs", instance.role, instance.address, started,
                   body.drain_timeout_s)
    deadline = time.monotonic() + body.drain_timeout_s
    while instance.outstanding_requests and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    left_at_budget = instance.outstanding_requests
    moved = 0
    if left_at_budget and instance.role == "decode" and rebalancer is not None:
        moved = rebalancer.move_all_off(instance.address)
        # The moved streams leave at their next read: wait until they have (a stream writing to a slow client
        # comes back to read soon), so the answer's `left` is what stopping the instance would migrate.
        settle = time.monotonic() + 10.0
        while instance.outstanding_requests > left_at_budget - moved and time.monotonic() < settle:
            await asyncio.sleep(POLL_S)
    return {"address": instance.address, "role": instance.role, "state": instance.state.value,
            "finished": max(0, started - left_at_budget), "moved": moved, "left": instance.outstanding_requests}


def resume_instance(registry: InstanceRegistry, body: ResumeRequest) -> dict:
    """Back into routing at its next passing health check."""
    instance = find_instance(registry, body.address, body.role)
    registry.release(instance)
    return {"address": instance.address, "role": instance.role, "held": instance.held}
