"""The health monitor's rounds: a busy instance whose requests end well is probed less often, nothing else changes."""

from __future__ import annotations

from coordinator.requests.failures import WorkerCallError, WorkerFailure
from coordinator.workers.health_monitor import HealthMonitor
from coordinator.workers.instances import InstanceRegistry, InstanceState, ReportedLoad
from coordinator.workers.client import HealthReport
from tests.helpers import FakeClock, wait_until


class FakeClient:
    """Answers Health at once (or fails for the addresses in `down`), counting the probes of each address."""

    def __init__(self):
        self.probes: dict[str, int] = {}
        self.down: set[str] = set()

    async def health(self, address: str, role: str, timeout: float = 2.0) -> HealthReport:
        self.probes[address] = self.probes.get(address, 0) + 1
        if address in self.down:
            raise WorkerCallError(WorkerFailure(role, address, "UNAVAILABLE", "connection refused"))
        return HealthReport(ReportedLoad(num_running=1), draining=False)


def monitor_of(registry: InstanceRegistry, client: FakeClient) -> tuple[HealthMonitor, FakeClock]:
    monitor = HealthMonitor(registry, client, interval_s=1, timeout_s=1, busy_interval_s=4)
    monitor.clock = clock = FakeClock()
    return monitor, clock


def a_request_ends_well(registry: InstanceRegistry, address: str) -> None:
    with registry.lease(registry.get("decode", address)):
        pass


async def test_a_busy_instance_that_answers_is_probed_only_every_busy_interval():
    registry = InstanceRegistry([], ["busy:1", "idle:1"])
    client = FakeClient()
    monitor, clock = monitor_of(registry, client)
    await monitor.check_all()
    with registry.lease(registry.get("decode", "busy:1")):  # a long request runs while short ones end well
        for _ in range(4):
            a_request_ends_well(registry, "busy:1")
            clock.now += 1
            await monitor.check_due()
        assert client.probes == {"busy:1": 2, "idle:1": 5}  # skipped 3 rounds, then due at the busy interval
        clock.now += 1
        await monitor.check_due()  # nothing ended well since its last probe: probed like any other
        assert client.probes == {"busy:1": 3, "idle:1": 6}
    a_request_ends_well(registry, "busy:1")
    clock.now += 1
    await monitor.check_due()  # nothing running on it any more: an idle instance
    assert client.probes == {"busy:1": 4, "idle:1": 7}
    assert registry.get("decode", "busy:1").reported.num_running == 1


async def test_a_busy_instance_whose_circuit_opened_or_that_failed_is_probed_every_round():
    registry = InstanceRegistry([], ["d:1"], failure_threshold=3)
    instance = registry.get("decode", "d:1")
    client = FakeClient()
    monitor, clock = monitor_of(registry, client)
    await monitor.check_all()
    with registry.lease(instance):
        a_request_ends_well(registry, "d:1")
        registry.record_failure(instance, "stream broke")  # circuit still closed, but not answering well
        clock.now += 1
        await monitor.check_due()
        assert client.probes["d:1"] == 2
        a_request_ends_well(registry, "d:1")
        registry.record_failure(instance, "connection reset", gone=True)
        clock.now += 1
        await monitor.check_due()
        assert client.probes["d:1"] == 3 and instance.state is InstanceState.HEALTHY  # the probe closed it again


async def test_instances_that_come_are_probed_and_those_that_leave_are_not():
    registry = InstanceRegistry([], ["old:1"])
    client = FakeClient()
    monitor, _ = monitor_of(registry, client)
    await monitor.check_due()
    registry.register("decode", "new:1")
    registry.deregister("decode", "old:1")
    await monitor.check_due()
    assert client.probes == {"old:1": 1, "new:1": 1}


async def test_check_all_probes_every_instance_even_busy_answering_ones():
    registry = InstanceRegistry(["p:1"], ["d0:1", "d1:1"])
    client = FakeClient()
    client.down.add("d1:1")
    monitor, _ = monitor_of(registry, client)
    await monitor.check_all()
    with registry.lease(registry.get("decode", "d0:1")):
        a_request_ends_well(registry, "d0:1")
        await monitor.check_all()
    assert client.probes == {"p:1": 2, "d0:1": 2, "d1:1": 2}
    assert registry.get("decode", "d1:1").consecutive_failures == 2


async def test_the_timer_probes_every_interval_until_stopped():
    registry = InstanceRegistry(["p:1"], ["d:1"])
    client = FakeClient()
    monitor = HealthMonitor(registry, client, interval_s=0.02, timeout_s=1)
    monitor.start()
    await wait_until(lambda: min(client.probes.get(a, 0) for a in ("p:1", "d:1")) >= 3, what="three rounds")
    await monitor.stop()
    probes = dict(client.probes)
    # A witness on the same interval, still running: once it has probed three more rounds, the stopped one would
    # have probed too.
    witness_client = FakeClient()
    witness = HealthMonitor(InstanceRegistry([], ["w:1"]), witness_client, interval_s=0.02, timeout_s=1)
    witness.start()
    try:
        await wait_until(lambda: witness_client.probes.get("w:1", 0) >= 3, what="the witness's three rounds")
    finally:
        await witness.stop()
    assert client.probes == probes and probes["p:1"] >= 3 and probes["d:1"] >= 3
