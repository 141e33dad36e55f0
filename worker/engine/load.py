"""What a worker reports about its queues and KV budget (its Health figures)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.engine.block_pool import PoolStats


@dataclass(frozen=True)
class WorkerLoad:
    """One engine's figures at one moment; every backend computes them the same way."""

    role: str
    model: str
    num_running: int
    num_waiting: int
    kv_capacity_tokens: int
    kv_used_tokens: int
    num_kv_leases: int = 0
    queued_prompt_tokens: int = 0
    pool: PoolStats | None = None  # blocks and prefix cache figures
    num_preemptions: int = 0
    loras: Any = None  # the LoraResidency, when the worker serves adapters
