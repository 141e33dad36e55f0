"""Profiles and workloads built by hand, for planner tests that need no worker."""

from __future__ import annotations

from planner.profile import (
    DecodeCosts,
    DecodePoint,
    PrefillCosts,
    PrefillPoint,
    WorkerProfile,
)
from planner.workload import TraceRequest, Workload


def prefill_costs(base_ms: float = 10.0, ms_per_token: float = 0.1, handoff_ms: float = 0.0,
                  kv_bytes_per_token: float = 512) -> PrefillCosts:
    point = PrefillPoint(prompt_tokens=100, prefill_ms=base_ms + 100 * ms_per_token, handoff_ms=handoff_ms,
                         kv_bytes=int(100 * kv_bytes_per_token))
    return PrefillCosts(base_ms=base_ms, ms_per_token=ms_per_token, handoff_base_ms=handoff_ms, handoff_ms_per_mib=0,
                        kv_bytes_per_token=kv_bytes_per_token, points=[point])


def decode_costs(base_ms: float = 15.0, ms_per_seq: float = 2.0, ms_per_context_token: float = 0.0) -> DecodeCosts:
    point = DecodePoint(batch_size=1, context_tokens=100, step_ms=base_ms + ms_per_seq + 100 * ms_per_context_token)
    return DecodeCosts(base_ms=base_ms, ms_per_seq=ms_per_seq, ms_per_context_token=ms_per_context_token,
                       points=[point])


def profiles(kv_capacity_tokens: int = 0, **costs) -> tuple[WorkerProfile, WorkerProfile]:
    """A (prefill, decode) pair of profiles; `costs` go to prefill_costs (prefill_*) and decode_costs (decode_*)."""
    pre = {k.removeprefix("prefill_"): v for k, v in costs.items() if k.startswith("prefill_")}
    dec = {k.removeprefix("decode_"): v for k, v in costs.items() if k.startswith("decode_")}
    return (WorkerProfile(role="prefill", worker="p:1", model="m", kv_capacity_tokens=0, prefill=prefill_costs(**pre)),
            WorkerProfile(role="decode", worker="d:1", model="m", kv_capacity_tokens=kv_capacity_tokens,
                          decode=decode_costs(**dec)))


def make_requests(*rows: tuple[float, int, int]) -> Workload:
    """A workload of (arrival_s, prompt_tokens, output_tokens) rows."""
    return Workload.of([TraceRequest(arrival_s=a, prompt_tokens=p, output_tokens=o) for a, p, o in rows])
