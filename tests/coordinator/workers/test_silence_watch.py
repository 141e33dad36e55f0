"""The silence watch: which instances it probes, when, and what a lost worker's calls end with."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.requests.failures import FailureKind, WorkerCallError, WorkerFailure
from coordinator.workers.instances import InstanceRegistry, InstanceState
from coordinator.requests.request import GenerationRequest, SamplingOptions
from coordinator.workers.silence_watch import MIN_SILENCE_S, SilenceWatch
from coordinator.workers.client import WorkerClient
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from tests.helpers import FakeClock, wait_until


class WatchedClient:
    """Health answers at once, or never for the addresses in `frozen`; records what was declared lost."""

    def __init__(self):
        self.frozen: set[str] = set()
        self.lost: dict[str, str] = {}

    async def probe(self, address: str, role: str, timeout: float = 2.0) -> None:
        if address in self.frozen:
            await asyncio.sleep(timeout)
            raise WorkerCallError(WorkerFailure(role, address, "DEADLINE_EXCEEDED", "Deadline Exceeded"))

    async def lose(self, address: str, reason: str) -> None:
        self.lost[address] = reason


def watch_of(registry: InstanceRegistry, client: WatchedClient) -> tuple[SilenceWatch, FakeClock]:
    clock = FakeClock(1000.0)
    return SilenceWatch(registry, client, silence_timeout_s=2.0, probe_timeout_s=0.05, clock=clock), clock


def test_the_silence_bound_follows_the_decode_step_cadence_within_its_limits():
    registry = InstanceRegistry(["p:1"], ["d:1"])
    watch, _ = watch_of(registry, WatchedClient())
    decode = registry.get("decode", "d:1")
    assert watch.bound(registry.get("prefill", "p:1")) == 2.0  # no steps to count: the configured bound
    assert watch.bound(decode) == 2.0  # no token yet
    decode.step_ms = 1
    assert watch.bound(decode) == MIN_SILENCE_S
    decode.step_ms = 20
    assert watch.bound(decode) == pytest.approx(1.0)
    decode.step_ms = 500
    assert watch.bound(decode) == 2.0


def test_only_instances_with_requests_in_flight_and_silent_past_their_bound_are_probed():
    registry = InstanceRegistry(["p:1"], ["d:1", "d:2"])
    watch, clock = watch_of(registry, WatchedClient())
    busy, idle = registry.get("decode", "d:1"), registry.get("decode", "d:2")
    busy.outstanding_requests = 1
    busy.last_heard = clock.now - 1.9
    idle.last_heard = clock.now - 100  # silent, but nothing is waiting on it
    assert watch.silent() == []
    clock.now += 0.2
    assert watch.silent() == [busy]


async def test_a_silent_worker_that_answers_its_probe_stays_in_rotation():
    registry = InstanceRegistry([], ["d:1"])
    client = WatchedClient()
    watch, clock = watch_of(registry, client)
    decode = registry.get("decode", "d:1")
    decode.outstanding_requests, decode.last_heard = 1, clock.now - 5
    await watch.probe(decode)
    assert decode.state is InstanceState.HEALTHY and client.lost == {}
    assert decode.last_heard == clock.now and watch.silent() == []


async def test_a_silent_worker_that_does_not_answer_is_declared_lost_and_its_calls_failed():
    registry = InstanceRegistry([], ["d:1", "d:2"])
    client = WatchedClient()
    client.frozen.add("d:1")
    watch, clock = watch_of(registry, client)
    frozen = registry.get("decode", "d:1")
    frozen.outstanding_requests, frozen.last_heard = 2, clock.now - 3
    watch.tick()
    watch.tick()  # a probe already running is not started twice
    probes = list(watch._probing.values())
    assert len(probes) == 1
    await asyncio.wait_for(asyncio.gather(*probes), 30)
    assert frozen.state is InstanceState.UNHEALTHY and "worker lost: silent for 3.0s" in frozen.reason
    assert list(client.lost) == ["d:1"] and client.lost["d:1"] == frozen.reason
    assert registry.get("decode", "d:2").state is InstanceState.HEALTHY
    await watch.stop()


def test_a_request_on_an_idle_instance_starts_its_silence_from_now():
    registry = InstanceRegistry([], ["d:1"])
    decode = registry.get("decode", "d:1")
    with registry.lease(decode):
        started = decode.last_heard
        assert started > 0
        with registry.lease(decode):  # already busy: its last sign of life stands
            assert decode.last_heard == started


class HangingDecode(pb_grpc.DecodeServiceServicer):
    """Accepts a decode and then says nothing more, like a frozen worker."""

    async def Decode(self, request, context):
        yield pb.DecodeEvent(accepted=pb.Accepted())
        await asyncio.Event().wait()


class HangingPrefill(pb_grpc.PrefillServiceServicer):
    """Takes a prefill and never answers; counts the prefills it holds."""

    def __init__(self):
        self.held = 0

    async def Prefill(self, request, context):
        self.held += 1
        await asyncio.Event().wait()


class HangingWorker(str):
    """The hanging worker's address, which also says how many prefills reached it."""

    def __new__(cls, address: str, prefills: HangingPrefill):
        worker = super().__new__(cls, address)
        worker.prefills = prefills
        return worker

    async def holds_prefills(self, count: int) -> None:
        await wait_until(lambda: self.prefills.held >= count, what=f"{count} prefills to reach the hanging worker")


@pytest.fixture
async def hanging_worker():
    server = grpc.aio.server()
    prefills = HangingPrefill()
    pb_grpc.add_DecodeServiceServicer_to_server(HangingDecode(), server)
    pb_grpc.add_PrefillServiceServicer_to_server(prefills, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield HangingWorker(f"127.0.0.1:{port}", prefills)
    await server.stop(None)


def a_request() -> GenerationRequest:
    return GenerationRequest(request_id="r-1", prompt_token_ids=[1, 2, 3], sampling=SamplingOptions())


async def test_calls_in_flight_to_a_lost_worker_fail_as_a_gone_worker_and_the_next_call_reconnects(hanging_worker):
    client = WorkerClient()
    stream = client.open_decode(hanging_worker, a_request(), 4, 64, timeout=30)
    assert await stream.read() is not None  # accepted
    read = asyncio.create_task(stream.read())
    prefill = asyncio.create_task(client.prefill(hanging_worker, a_request(), 4, "d:1", timeout=30))
    await hanging_worker.holds_prefills(1)  # both calls are in flight
    await client.lose(hanging_worker, "worker lost: silent")
    for task, stage in ((read, "decode"), (prefill, "prefill")):
        with pytest.raises(WorkerCallError) as caught:
            await task
        failure = caught.value.failure
        assert (failure.stage, failure.code, failure.details) == (stage, "UNAVAILABLE", "worker lost: silent")
        assert failure.kind is FailureKind.WORKER_GONE  # so its stream migrates, its prefill goes elsewhere
    again = client.open_decode(hanging_worker, a_request(), 4, 64, timeout=30)
    assert await again.read() is not None
    again.cancel()
    await client.close()


async def test_a_call_whose_own_task_is_cancelled_is_still_cancelled_after_its_worker_is_lost(hanging_worker):
    client = WorkerClient()
    prefill = asyncio.create_task(client.prefill(hanging_worker, a_request(), 4, "d:1", timeout=30))
    await hanging_worker.holds_prefills(1)
    prefill.cancel()
    await client.lose(hanging_worker, "worker lost: silent")
    with pytest.raises(asyncio.CancelledError):
        await prefill
    await client.close()


class AnsweringLate(WatchedClient):
    """Health fails with `code`; with `token_meanwhile`, a token comes from the worker while it is asked."""

    def __init__(self, registry: InstanceRegistry, code: str, token_meanwhile: bool = False):
        super().__init__()
        self.registry, self.code, self.token_meanwhile = registry, code, token_meanwhile

    async def probe(self, address: str, role: str, timeout: float = 2.0) -> None:
        if self.token_meanwhile:
            self.registry.get(role, address).last_heard += 0.01
        raise WorkerCallError(WorkerFailure(role, address, self.code, "..."))


@pytest.mark.parametrize("code, token_meanwhile", [("UNAUTHENTICATED", False), ("DEADLINE_EXCEEDED", True)])
async def test_a_worker_that_answers_with_an_error_or_sends_a_token_meanwhile_is_not_lost(code, token_meanwhile):
    registry = InstanceRegistry([], ["d:1"])
    client = AnsweringLate(registry, code, token_meanwhile)
    watch, clock = watch_of(registry, client)
    decode = registry.get("decode", "d:1")
    decode.outstanding_requests, decode.last_heard = 1, clock.now - 5
    await watch.probe(decode)
    assert decode.state is InstanceState.HEALTHY and client.lost == {}


class ReloadingTls:
    """A TLS link whose certificates were reloaded: its generation moves."""

    generation = 0


async def test_a_lost_worker_fails_the_calls_on_a_channel_a_reload_retired_too(hanging_worker, monkeypatch):
    import security.grpc_auth as grpc_auth

    # Plain channels, as TLS would give; what is under test is which channels a loss closes.
    monkeypatch.setattr(grpc_auth, "open_channel", lambda address, tls, options: grpc.aio.insecure_channel(address))
    tls = ReloadingTls()
    client = WorkerClient()
    client._channels.tls = tls
    before = asyncio.create_task(client.prefill(hanging_worker, a_request(), 4, "d:1", timeout=30))
    await hanging_worker.holds_prefills(1)
    tls.generation += 1  # a SIGHUP: the next call opens a new channel, the old one has a grace period
    after = asyncio.create_task(client.prefill(hanging_worker, a_request(), 4, "d:1", timeout=30))
    await hanging_worker.holds_prefills(2)
    assert len(client._channels.of(hanging_worker)) == 2
    await client.lose(hanging_worker, "worker lost: silent")
    for task in (before, after):
        with pytest.raises(WorkerCallError) as caught:
            await asyncio.wait_for(task, 2)
        assert caught.value.failure.code == "UNAVAILABLE"
    assert client._channels.of(hanging_worker) == []
    await client.close()
