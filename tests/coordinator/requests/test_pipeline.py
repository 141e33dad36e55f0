"""The request pipeline's attempts, retries and migrations, driven by scripted workers (no servers)."""

from __future__ import annotations

import asyncio
import inspect
import time

import pytest

from coordinator.cluster.wire_formats import ClusterFormats
from coordinator.errors import WorkerError
from coordinator.requests.failures import WorkerCallError, WorkerFailure
from coordinator.workers.instances import InstanceRegistry
from coordinator.requests.limits import ModelLimits
from coordinator.metrics import CoordinatorMetrics, NullMetrics
from coordinator.requests.draft_corpus import DraftCorpus, SpeculativeConfig
from tests.coordinator.requests.test_draft_corpus import lists
from coordinator.requests.pipeline import RequestPipeline
from coordinator.requests.request import Finished, FinishReason, GenerationRequest, SamplingOptions, TokenDelta
from coordinator.requests.queue import RequestQueue
from coordinator.scheduling.policies import RoundRobinPolicy
from coordinator.scheduling.router import Router
from coordinator.workers.client import DecodeAccepted, PrefillResult
from proto import worker_pb2 as pb
from proto.wire_versions import THIS_PROCESS

HANG = object()  # a stream that sends nothing more
PROMPT = [1, 2, 3]


def token(index: int, token_id: int, final: bool = False) -> pb.TokenEvent:
    return pb.TokenEvent(token_id=token_id, text=f"<{token_id}>", index=index, time_ms=1.0,
                         finish_reason=pb.FINISH_REASON_LENGTH if final else pb.FINISH_REASON_UNSPECIFIED,
                         logprob=-0.5, batch_size=1)


def failure(stage: str, address: str, code: str, details: str = "",
            reason: int = pb.FAILURE_REASON_UNSPECIFIED) -> WorkerCallError:
    return WorkerCallError(WorkerFailure(stage, address, code, details, reason))


class ScriptedStream:
    def __init__(self, events: list):
        self.events = list(events)

    async def read(self):
        await asyncio.sleep(0)  # as a worker's answer, never there before the loop turns (the prefill runs first)
        item = self.events.pop(0) if self.events else HANG
        if item is HANG:
            await asyncio.get_running_loop().create_future()
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self) -> None:
        pass


class ScriptedWorkers:
    """WorkerClient stand-in: each decode call plays the next script of its address; prefills fail as told."""

    takes_sampling_pb = True

    def __init__(self, decode_scripts: dict[str, list[list]], prefill_errors: dict[str, Exception] | None = None):
        self.decode_scripts = decode_scripts
        self.prefill_errors = prefill_errors or {}
        self.decode_calls: list[tuple[str, GenerationRequest]] = []
        self.traceparents: list[tuple[str, str]] = []  # (call, traceparent) in call order

    def open_decode(self, address, request, max_tokens, max_seq_len, timeout, local_prefill=False, traceparent="",
                    sampling=None):
        self.decode_calls.append((address, request))
        self.traceparents.append(("decode", traceparent))
        return ScriptedStream(self.decode_scripts[address].pop(0))

    async def prefill(self, address, request, max_tokens, decode_address, timeout, kv_data_address="",
                      kv_transfer_token="", traceparent="", decode_cached_tokens=0, sampling=None,
                      kv_layout_version=0, pull_from="", pull_tokens=0):
        self.traceparents.append(("prefill", traceparent))
        if address in self.prefill_errors:
            raise self.prefill_errors[address]
        return PrefillResult(first_token_id=0, prefill_time_ms=1.0, kv_bytes=0, kv_transfer_ms=0.5, forward_ms=0.75)


class CountingMetrics(NullMetrics):
    def __init__(self):
        self.num_retries = self.num_migrations = 0

    def retried(self) -> None:
        self.num_retries += 1

    def migrated(self) -> None:
        self.num_migrations += 1


def make_pipeline(workers, prefill: list[str], decode: list[str], first_token_timeout: float = 5.0):
    registry = InstanceRegistry(prefill, decode)
    limits = ModelLimits(max_seq_len=64, max_input_token_len=32, max_iter_times=16, max_position_embeddings=64)
    metrics = CountingMetrics()
    pipeline = RequestPipeline(workers, Router(registry, RoundRobinPolicy()), registry, limits, RequestQueue(4),
                               first_token_timeout, 10.0, metrics, max_retry=2, max_migrations=1)
    return pipeline, registry, metrics


async def run(pipeline, max_tokens: int) -> list:
    request = GenerationRequest("r", PROMPT, SamplingOptions(), max_tokens)
    return [event async for event in pipeline.generate(request)]


def assert_all_leases_returned(registry: InstanceRegistry) -> None:
    for instance in registry.instances("prefill") + registry.instances("decode"):
        assert (instance.outstanding_requests, instance.outstanding_prompt_tokens) == (0, 0), instance.address


async def test_a_prefill_worker_gone_before_the_first_token_is_retried_on_another_and_taken_out():
    accepted = DecodeAccepted("")
    workers = ScriptedWorkers({"d0:1": [[accepted, HANG], [accepted, token(0, 7), token(1, 8, final=True)]]},
                              {"p0:1": failure("prefill", "p0:1", "UNAVAILABLE", "connection refused")})
    pipeline, registry, metrics = make_pipeline(workers, ["p0:1", "p1:1"], ["d0:1"])
    events = await run(pipeline, max_tokens=2)
    assert [e.token_id for e in events if isinstance(e, TokenDelta)] == [7, 8]
    assert events[-1] == Finished(FinishReason.LENGTH, prompt_tokens=3, completion_tokens=2, prefill_time_ms=1.0,
                                  decode_time_ms=(1.0,))
    assert metrics.num_retries == 1 and metrics.num_migrations == 0
    assert registry.get("prefill", "p0:1").reason == "UNAVAILABLE: connection refused"
    assert [i.address for i in registry.available("prefill")] == ["p1:1"]
    assert_all_leases_returned(registry)


async def test_a_prefill_failing_under_the_first_token_wait_leaves_no_cancellation_behind():
    accepted = DecodeAccepted("")
    workers = ScriptedWorkers({"d0:1": [[accepted, HANG]]},
                              {"p0:1": failure("prefill", "p0:1", "INVALID_ARGUMENT", "bad grammar")})
    pipeline, registry, _ = make_pipeline(workers, ["p0:1"], ["d0:1"])
    with pytest.raises(WorkerError, match="bad grammar"):
        await run(pipeline, max_tokens=2)
    assert asyncio.current_task().cancelling() == 0  # the interrupt took its cancellation back
    await asyncio.sleep(0)  # and none is still pending for this task's next wait
    assert_all_leases_returned(registry)


async def test_a_client_leaving_as_the_prefill_fails_is_a_cancellation_not_a_retry():
    accepted = DecodeAccepted("")
    prefill_failed = asyncio.Event()

    class FailingAfterSignal(ScriptedWorkers):
        async def prefill(self, *args, **kwargs):
            await prefill_failed.wait()
            raise failure("prefill", "p0:1", "UNAVAILABLE", "connection refused")

    workers = FailingAfterSignal({"d0:1": [[accepted, HANG], [accepted, HANG]]})
    pipeline, registry, metrics = make_pipeline(workers, ["p0:1", "p1:1"], ["d0:1"])
    request = asyncio.create_task(run(pipeline, max_tokens=2))
    while not workers.decode_calls:
        await asyncio.sleep(0)
    for _ in range(3):
        await asyncio.sleep(0)  # the request now waits for its first token
    prefill_failed.set()
    request.cancel()  # in the same turn: both cancel the request's task
    with pytest.raises(asyncio.CancelledError):
        await request
    assert metrics.num_retries == 0 and len(workers.decode_calls) == 1
    assert_all_leases_returned(registry)


async def test_a_decode_worker_lost_mid_stream_is_replaced_and_the_stream_continues():
    accepted = DecodeAccepted("")
    workers = ScriptedWorkers({
        "d0:1": [[accepted, token(0, 7), token(1, 8), failure("decode", "d0:1", "UNAVAILABLE", "killed")]],
        "d1:1": [[accepted, token(0, 9), token(1, 10, final=True)]],
    })
    pipeline, registry, metrics = make_pipeline(workers, ["p0:1"], ["d0:1", "d1:1"])
    events = await run(pipeline, max_tokens=4)
    deltas = [e for e in events if isinstance(e, TokenDelta)]
    assert [(d.index, d.token_id) for d in deltas] == [(0, 7), (1, 8), (2, 9), (3, 10)]
    assert events[-1].completion_tokens == 4
    address, resumed = workers.decode_calls[-1]
    assert address == "d1:1" and resumed.request_id == "r.1" and resumed.prompt_token_ids == PROMPT + [7, 8]
    assert metrics.num_migrations == 1
    assert not registry.get("decode", "d0:1").available
    assert_all_leases_returned(registry)


async def test_a_kv_cache_that_never_arrived_counts_against_the_prefill_instance_and_is_retried():
    accepted = DecodeAccepted("")
    lost = failure("decode", "d0:1", "DEADLINE_EXCEEDED", "KV cache did not arrive within 5s",
                   pb.FAILURE_REASON_KV_NOT_RECEIVED)
    workers = ScriptedWorkers({"d0:1": [[accepted, lost], [accepted, token(0, 7, final=True)]]})
    pipeline, registry, metrics = make_pipeline(workers, ["p0:1", "p1:1"], ["d0:1"])
    events = await run(pipeline, max_tokens=1)
    assert isinstance(events[-1], Finished) and metrics.num_retries == 1
    p0 = registry.get("prefill", "p0:1")
    assert p0.available and p0.consecutive_failures == 1  # one slow transfer does not prove it gone
    assert registry.get("decode", "d0:1").consecutive_failures == 0
    assert_all_leases_returned(registry)


async def test_the_decode_calls_own_deadline_ends_the_request_without_a_retry():
    expired = failure("decode", "d0:1", "DEADLINE_EXCEEDED", "Deadline Exceeded")
    workers = ScriptedWorkers({"d0:1": [[DecodeAccepted(""), expired]]})
    pipeline, registry, metrics = make_pipeline(workers, ["p0:1", "p1:1"], ["d0:1"])
    with pytest.raises(WorkerError) as err:
        await run(pipeline, max_tokens=1)
    assert err.value.status == 504 and "exceeded its deadline of 10.0s" in err.value.message
    assert metrics.num_retries == 0 and all(i.consecutive_failures == 0 for i in registry.instances("prefill"))
    assert_all_leases_returned(registry)


async def test_no_first_token_within_first_token_timeout_fails_with_504():
    workers = ScriptedWorkers({"d0:1": [[DecodeAccepted(""), HANG]]})
    pipeline, registry, _ = make_pipeline(workers, ["p0:1"], ["d0:1"], first_token_timeout=0.05)
    with pytest.raises(WorkerError) as err:
        await run(pipeline, max_tokens=1)
    assert err.value.status == 504
    assert err.value.message == "no first token from prefill p0:1 / decode d0:1 within first_token_timeout=0.05s"
    assert_all_leases_returned(registry)


def test_null_metrics_has_the_same_pipeline_methods_as_coordinator_metrics():
    for name, method in inspect.getmembers(NullMetrics, inspect.isfunction):
        assert inspect.signature(getattr(CoordinatorMetrics, name)) == inspect.signature(method), name


class TokenTimes(NullMetrics):
    def __init__(self):
        self.calls: list[tuple[int, float]] = []

    def token(self, index: int, since_start_s: float, since_last_s: float) -> None:
        self.calls.append((index, since_start_s))


async def test_time_to_first_token_counts_from_the_requests_arrival():
    workers = ScriptedWorkers({"d0:1": [[DecodeAccepted(""), token(0, 7), token(1, 8, final=True)]]})
    pipeline, _, _ = make_pipeline(workers, ["p0:1"], ["d0:1"])
    pipeline.metrics = pipeline.attempts.metrics = metrics = TokenTimes()
    request = GenerationRequest("r", PROMPT, SamplingOptions(), 2, arrived_at=time.monotonic() - 0.5)
    [event async for event in pipeline.generate(request)]
    assert [index for index, _ in metrics.calls] == [0, 1]
    assert metrics.calls[0][1] >= 0.5


class PhaseTimes(CountingMetrics):
    def __init__(self):
        super().__init__()
        self.observed: list[dict[str, float]] = []

    def phases(self, durations: dict[str, float]) -> None:
        self.observed.append(dict(durations))


def migrating_workers() -> ScriptedWorkers:
    accepted = DecodeAccepted("")
    return ScriptedWorkers({
        "d0:1": [[accepted, token(0, 7), token(1, 8), failure("decode", "d0:1", "UNAVAILABLE", "killed")]],
        "d1:1": [[accepted, token(0, 9), token(1, 10, final=True)]],
    })


async def test_a_migrated_generation_observes_each_phase_once_summed_over_its_attempts():
    pipeline, _, _ = make_pipeline(migrating_workers(), ["p0:1"], ["d0:1", "d1:1"])
    pipeline.metrics = pipeline.attempts.metrics = metrics = PhaseTimes()
    await run(pipeline, max_tokens=4)
    [observed] = metrics.observed
    assert set(observed) == {"queue", "route", "decode_admission", "prefill", "prefill_queue", "prefill_forward",
                             "kv_transfer", "first_token", "decode"}
    # Two prefills by the scripted workers' own account: 1 ms each, 0.75 of it the forward, 0.5 ms of KV transfer.
    assert observed["prefill_forward"] == pytest.approx(0.0015)
    assert observed["prefill_queue"] == pytest.approx(0.0005)
    assert observed["kv_transfer"] == pytest.approx(0.001)


async def test_each_attempt_adds_its_own_time_to_the_phases():
    one = make_pipeline(ScriptedWorkers({"d0:1": [[DecodeAccepted(""), token(0, 9), token(1, 10, final=True)]]}),
                        ["p0:1"], ["d0:1"])[0]
    one.metrics = one.attempts.metrics = single = PhaseTimes()
    await run(one, max_tokens=2)
    two = make_pipeline(migrating_workers(), ["p0:1"], ["d0:1", "d1:1"])[0]
    two.metrics = two.attempts.metrics = migrated = PhaseTimes()
    await run(two, max_tokens=4)
    # The scripted workers' own figures make these exact: the migrated request prefilled twice.
    assert migrated.observed[0]["prefill_forward"] == pytest.approx(2 * single.observed[0]["prefill_forward"])
    assert set(migrated.observed[0]) == set(single.observed[0])


async def test_a_migrated_generation_is_one_trace_with_an_attempt_span_per_decode_worker(span_exporter):
    from opentelemetry.trace import SpanKind, StatusCode

    from coordinator.requests.trace import CURRENT_REQUEST, RequestTrace

    workers = migrating_workers()
    pipeline, _, _ = make_pipeline(workers, ["p0:1"], ["d0:1", "d1:1"])
    request = RequestTrace("POST", "/v1/completions", {})
    token_ = CURRENT_REQUEST.set(request)
    try:
        await run(pipeline, max_tokens=4)
    finally:
        CURRENT_REQUEST.reset(token_)
        request.end(200)
    spans = span_exporter.get_finished_spans()
    assert len({s.context.trace_id for s in spans}) == 1
    root = next(s for s in spans if s.name == "POST /v1/completions")
    attempts = sorted((s for s in spans if s.name == "attempt"), key=lambda s: s.start_time)
    assert [a.parent.span_id for a in attempts] == [root.context.span_id] * 2
    assert [(a.attributes["pdserve.decode"], a.attributes["pdserve.migration"]) for a in attempts] == \
        [("d0:1", False), ("d1:1", True)]
    assert attempts[0].status.status_code is StatusCode.ERROR and attempts[1].status.status_code is StatusCode.UNSET
    for attempt in attempts:
        names = [s.name for s in spans if s.parent is not None and s.parent.span_id == attempt.context.span_id]
        assert sorted(names) == ["decode", "decode_admission", "first_token", "prefill", "route"]
    # Each decode call carried its attempt's context and each prefill its own client span's: the workers'
    # spans hang from them.
    sent = {call: [tp.rsplit("-", 1)[0] for c, tp in workers.traceparents if c == call]  # less the flags
            for call in ("decode", "prefill")}
    assert sent["decode"] == [f"00-{trace_hex(a)}" for a in attempts]
    prefills = sorted((s for s in spans if s.name == "prefill"), key=lambda s: s.start_time)
    assert all(s.kind is SpanKind.CLIENT for s in prefills)
    assert sent["prefill"] == [f"00-{trace_hex(s)}" for s in prefills]


def trace_hex(span) -> str:
    return f"{span.context.trace_id:032x}-{span.context.span_id:016x}"


async def test_an_untraced_generation_sends_no_trace_context():
    workers = migrating_workers()
    pipeline, _, _ = make_pipeline(workers, ["p0:1"], ["d0:1", "d1:1"])
    await run(pipeline, max_tokens=4)
    assert workers.traceparents and all(tp == "" for _, tp in workers.traceparents)



def with_drafts(pipeline) -> DraftCorpus:
    pipeline.drafts = DraftCorpus(SpeculativeConfig(enabled=True, tail_lengths=[2], min_tail_tokens=2), "m")
    return pipeline.drafts


async def test_a_finished_output_goes_with_the_next_identical_prompt_as_a_hint_once_per_request():
    accepted = DecodeAccepted("")
    workers = ScriptedWorkers({"d0:1": [[accepted, token(0, 7), token(1, 8, final=True)],
                                        [accepted, token(0, 7), failure("decode", "d0:1", "DEADLINE_EXCEEDED", "")],
                                        [accepted, token(0, 9, final=True)]]})
    pipeline, _, _ = make_pipeline(workers, ["p0:1"], ["d0:1"])
    drafts = with_drafts(pipeline)
    await run(pipeline, max_tokens=2)
    with pytest.raises(WorkerError):  # past its deadline: failed, so not kept
        await run(pipeline, max_tokens=2)
    assert drafts.num_entries == 1
    await run(pipeline, max_tokens=1)
    hints = [lists(request.draft_hints) for _, request in workers.decode_calls]
    assert hints == [[], [[7, 8]], [[7, 8]]]


async def test_a_request_with_drafting_off_is_sent_no_hints_and_counted():
    accepted = DecodeAccepted("")
    workers = ScriptedWorkers({"d0:1": [[accepted, token(0, 7, final=True)], [accepted, token(0, 7, final=True)]]})
    pipeline, _, _ = make_pipeline(workers, ["p0:1"], ["d0:1"])
    pipeline.metrics = CoordinatorMetrics()
    with_drafts(pipeline)
    await run(pipeline, max_tokens=1)
    request = GenerationRequest("r", PROMPT, SamplingOptions(), 1, no_drafts=True)
    [event async for event in pipeline.generate(request)]
    _, sent = workers.decode_calls[-1]
    assert sent.no_drafts and sent.draft_hints == ()
    assert pipeline.metrics.drafts.drafting_off == 1 and pipeline.metrics.drafts.hints_sent == 0


async def test_draft_hints_go_only_where_the_cluster_and_the_decode_worker_read_them_and_count_only_when_sent():
    accepted = DecodeAccepted("")
    workers = ScriptedWorkers({"d0:1": [[accepted, token(0, 7), token(1, 8, final=True)] for _ in range(4)]})
    pipeline, registry, _ = make_pipeline(workers, ["p0:1"], ["d0:1"])
    pipeline.metrics = pipeline.attempts.metrics = CoordinatorMetrics()
    pipeline.attempts.formats = ClusterFormats(registry)
    with_drafts(pipeline)
    decode = registry.get("decode", "d0:1")
    await run(pipeline, max_tokens=2)  # its answer is kept; the worker has announced nothing: release 0.1.0
    await run(pipeline, max_tokens=2)
    registry.record_health(decode, None, draining=False, versions=THIS_PROCESS)  # it announces this release
    await run(pipeline, max_tokens=2)  # the prefill worker has not: the cluster does not write version 2 yet
    registry.record_health(registry.get("prefill", "p0:1"), None, draining=False, versions=THIS_PROCESS)
    await run(pipeline, max_tokens=2)
    assert [lists(request.draft_hints) for _, request in workers.decode_calls] == [[], [], [], [[7, 8]]]
    assert pipeline.metrics.drafts.hints_sent == 1
    used = {(s.labels["format"], s.labels["version"]): s.value for family in pipeline.metrics.registry.collect()
            for s in family.samples if s.name == "pdserve_wire_format_requests_total"}
    assert used[("decode_request", "1")] == 3 and used[("decode_request", "3")] == 1
    assert used[("kv_layout", "0")] == 4  # what these scripted decode workers accepted
