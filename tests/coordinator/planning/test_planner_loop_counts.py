"""The online planner's counts by role as GET /v1/plan and its metrics show them: prefill and decode always, encode
only where encode workers run, and the encode count from the window's Encode calls."""

from __future__ import annotations

import asyncio

from coordinator.metrics import PlannerCollector
from coordinator.planning.planner_loop import PlannerLoop
from coordinator.workers.instances import InstanceRegistry
from planner.settings import PlannerConfig

CONFIG = PlannerConfig(enabled=True, window_s=10, interval_s=1)


def plan_with(encoders: int) -> PlannerLoop:
    registry = InstanceRegistry(["p:1"], ["d:1"])
    for i in range(encoders):
        registry.register("encode", f"e:{i}")
    return PlannerLoop(CONFIG, registry, "load_balance")


def test_without_encode_workers_the_plan_names_prefill_and_decode_only():
    loop = plan_with(0)
    assert loop.describe()["current"] == {"prefill": 1, "decode": 1}
    assert loop.describe()["desired"] is None  # no decision yet
    loop.damper.desired = (1, 2)
    assert loop.describe()["desired"] == {"prefill": 1, "decode": 2}
    current = next(f for f in PlannerCollector(loop).collect() if f.name == "pdserve_planner_current_instances")
    assert [s.labels["role"] for s in current.samples] == ["prefill", "decode"]


def test_with_encode_workers_the_plan_counts_them_and_asks_for_what_the_encode_calls_needed():
    loop = plan_with(1)
    for t in range(8):  # 1.4 s of encoding per second of the window: two workers at 70%
        loop.encoded(1.4 * CONFIG.window_s / 8, 3)

    async def one_step():
        loop.start()
        try:
            await loop.step()
        finally:
            await loop.stop()

    asyncio.run(one_step())
    assert loop.describe()["current"] == {"prefill": 1, "decode": 1, "encode": 1}
    assert loop.encode_desired == 2
    loop.damper.desired = (1, 1)
    assert loop.describe()["desired"] == {"prefill": 1, "decode": 1, "encode": 2}
    desired = next(f for f in PlannerCollector(loop).collect() if f.name == "pdserve_planner_desired_instances")
    assert {s.labels["role"]: s.value for s in desired.samples} == {"prefill": 1, "decode": 1, "encode": 2}
