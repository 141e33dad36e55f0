"""One trace per request across the coordinator and both workers, exported over OTLP to a collector in the test
process, and the same phases in `pdserve_request_phase_seconds`: a PD request, a locally prefilled one and one
migrated to another decode worker."""

from __future__ import annotations

import os
import secrets
import signal

import httpx
import pytest

from coordinator.requests.trace import SEQUENTIAL_PHASES
from tests.helpers import ServerProcess, health, pdserve_argv, scrape, wait_for, write_config
from tests.otlp_collector import CollectedSpan, OtlpCollector

pytestmark = pytest.mark.system

LOCAL_PREFILL_BELOW = 12  # prompt tokens: shorter prompts are prefilled on the decode worker
SIM_FLAGS = ("--simulate", "--sim-decode-base-ms", "20", "--sim-prefill-base-ms", "15")
SERVER, CLIENT = 2, 3  # OTLP span kinds
# A stream still running (20 ms a token) when the test, on a loaded machine, has read its first tokens and found
# the decode worker to kill: with the default maxIterTimes (12) it could end in a quarter of a second.
MIGRATED_TOKENS = 300
LONG_PROMPT = "Tell me a long story about a lighthouse keeper and the ships that pass in the night."


class TracedCluster:
    """A coordinator, a prefill worker and two decode workers, all exporting their spans to `collector`."""

    def __init__(self, model_dir, tmp):
        self.collector = OtlpCollector()
        env = self.collector.env()
        self.prefill = self._worker("prefill", env)
        self.decodes = [self._worker("decode", env) for _ in range(2)]
        config = write_config(tmp / "ms_coordinator.json", [self.prefill.address], [d.address for d in self.decodes],
                              model_dir, sections={"digs_scheduler_config": {
                                  "algorithm_type": "cache_affinity", "local_prefill_max_tokens": LOCAL_PREFILL_BELOW}},
                              maxIterTimes=MIGRATED_TOKENS)
        self.coordinator = ServerProcess(pdserve_argv("coordinator", "--config", str(config)),
                                         "pdserve coordinator ready:", env=env)
        self.url = self.coordinator.address

    @staticmethod
    def _worker(role: str, env: dict) -> ServerProcess:
        return ServerProcess(pdserve_argv("worker", "--role", role, "--port", "0", *SIM_FLAGS), "pdserve worker ready:",
                             timeout_s=30, env=env)

    def stop(self) -> None:
        for proc in (self.coordinator, self.prefill, *self.decodes):
            proc.stop()
        self.collector.stop()


@pytest.fixture(scope="module")
def traced(model_dir, tmp_path_factory):
    cluster = TracedCluster(model_dir, tmp_path_factory.mktemp("traced"))
    yield cluster
    cluster.stop()


def client_traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def by_name(spans: list[CollectedSpan], name: str, service: str) -> list[CollectedSpan]:
    return [s for s in spans if s.name == name and s.service == service]


def one(spans: list[CollectedSpan], name: str, service: str) -> CollectedSpan:
    found = by_name(spans, name, service)
    assert len(found) == 1, f"{service} {name}: {found}"
    return found[0]


def children(spans: list[CollectedSpan], parent: CollectedSpan) -> dict[str, CollectedSpan]:
    """`parent`'s children in its own process (a worker's spans may hang from it too)."""
    found = [s for s in spans if s.parent_span_id == parent.span_id and s.service == parent.service]
    assert len({s.name for s in found}) == len(found), found
    return {s.name: s for s in found}


def has(*names: tuple[str, str]):
    """A predicate on a trace's spans: every (service, span name) has come."""
    return lambda spans: all(any(s.service == svc and s.name == n for s in spans) for svc, n in names)


def chat(url: str, prompt: str, traceparent: str, **fields) -> httpx.Response:
    body = {"model": "pdserve-tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"traceparent": traceparent}, timeout=60)


def test_a_pd_request_is_one_trace_joining_the_clients_across_coordinator_prefill_and_decode(traced):
    traceparent, trace_id, client_span = client_traceparent()
    # Long enough (about 1 s) that answering after the last token is a small share of it.
    resp = chat(traced.url, LONG_PROMPT, traceparent, max_tokens=48)
    assert resp.status_code == 200, resp.text
    # A worker ends its request's span before recording the parts under it, so an export batch may bring the span
    # without its parts: wait for the parts too.
    wait_for_trace = lambda spans: has(("pdserve-coordinator", "POST /v1/chat/completions"),  # noqa: E731
                                       ("pdserve-prefill", "prefill"), ("pdserve-prefill", "kv_transfer"),
                                       ("pdserve-decode", "decode"), ("pdserve-decode", "first_step"))(
        [s for s in spans if s.trace_id == trace_id])
    traced.collector.wait_for(wait_for_trace)
    spans = traced.collector.trace(trace_id)

    root = one(spans, "POST /v1/chat/completions", "pdserve-coordinator")
    assert root.parent_span_id == client_span and root.kind == SERVER
    assert root.attributes["http.response.status_code"] == 200
    top = children(spans, root)
    assert {"tokenize", "queue", "attempt"} <= set(top)
    attempt = top["attempt"]
    assert attempt.attributes["pdserve.attempt"] == 0 and attempt.attributes["pdserve.migration"] is False
    phases = children(spans, attempt)
    assert {"route", "decode_admission", "prefill", "first_token", "decode"} <= set(phases)
    assert phases["prefill"].kind == CLIENT and phases["prefill"].attributes["pdserve.kv_bytes"] > 0

    # The prefill worker's spans hang from the coordinator's prefill call, the decode worker's from the attempt.
    prefill = one(spans, "prefill", "pdserve-prefill")
    assert prefill.parent_span_id == phases["prefill"].span_id and prefill.kind == SERVER
    prefill_parts = children(spans, prefill)
    assert {"prefill_queue", "prefill_forward", "kv_transfer"} <= set(prefill_parts)
    assert prefill_parts["prefill_queue"].end_ns <= prefill_parts["prefill_forward"].start_ns
    sent = prefill_parts["kv_transfer"].attributes
    decode = one(spans, "decode", "pdserve-decode")
    assert decode.parent_span_id == attempt.span_id and decode.attributes["pdserve.local_prefill"] is False
    decode_parts = children(spans, decode)
    assert {"decode_admission", "kv_transfer", "first_step"} <= set(decode_parts)
    received = decode_parts["kv_transfer"].attributes
    # The KV transfer, measured at both ends: the same bytes over the same transport.
    assert sent["pdserve.kv.side"] == "send" and received["pdserve.kv.side"] == "receive"
    assert sent["pdserve.kv.bytes"] == received["pdserve.kv.bytes"] == phases["prefill"].attributes["pdserve.kv_bytes"]
    assert sent["pdserve.kv.transport"] == received["pdserve.kv.transport"] == "tcp"
    assert 0 < received["pdserve.kv.duration_ms"] <= sent["pdserve.kv.duration_ms"]

    # The phases that follow one another make up the request's latency.
    coordinator_phases = {**top, **phases}  # tokenize and queue under the root, the rest under the attempt
    total = sum(coordinator_phases[name].duration_s for name in SEQUENTIAL_PHASES)
    assert abs(total - root.duration_s) <= 0.05 * root.duration_s, (total, root.duration_s)


def test_an_attempt_span_carries_the_prompt_tokens_the_index_expected_each_instance_to_hold(traced):
    def attempt_of(prompt: str) -> dict:
        traceparent, trace_id, _ = client_traceparent()
        resp = httpx.post(f"{traced.url}/v1/completions", json={"model": "pdserve-tiny", "prompt": prompt,
                                                                 "max_tokens": 4}, headers={"traceparent": traceparent},
                          timeout=60)
        assert resp.status_code == 200, resp.text
        traced.collector.wait_for(lambda spans: has(("pdserve-coordinator", "attempt"))(
            [s for s in spans if s.trace_id == trace_id]))
        return one(traced.collector.trace(trace_id), "attempt", "pdserve-coordinator").attributes

    story = " ".join([LONG_PROMPT] * 6)  # well over LOCAL_PREFILL_BELOW tokens: disaggregated
    first = attempt_of(story)
    assert first["pdserve.prefill"] != "local" and first["pdserve.prompt_tokens"] > 4 * LOCAL_PREFILL_BELOW
    assert first["pdserve.prefill.expected_cached_tokens"] == first["pdserve.decode.expected_cached_tokens"] == 0
    # Again: the decode worker holding it is chosen, and prefills what it lacks itself when that is short.
    again = wait_for(lambda: (a := attempt_of(story))["pdserve.decode.expected_cached_tokens"] > 0 and a, 10,
                     "the decode worker's blocks to reach the index")
    lacking = again["pdserve.prompt_tokens"] - again["pdserve.decode.expected_cached_tokens"]
    assert again["pdserve.decode"] == first["pdserve.decode"] and 0 < lacking <= 16  # less than one block
    assert (again["pdserve.prefill"] == "local") == (lacking < LOCAL_PREFILL_BELOW)
    # The same story and a long new question: disaggregated, onto the prefill worker that holds the story.
    longer = attempt_of(story + " " + " ".join(["And then what happened to the keeper's lamp?"] * 6))
    assert longer["pdserve.prefill"] == first["pdserve.prefill"]
    assert 0 < longer["pdserve.prefill.expected_cached_tokens"] < longer["pdserve.prompt_tokens"]


def test_a_locally_prefilled_request_has_no_prefill_worker_in_its_trace(traced):
    traceparent, trace_id, _ = client_traceparent()
    resp = httpx.post(f"{traced.url}/v1/completions", json={"model": "pdserve-tiny", "prompt": "Hi", "max_tokens": 8,
                                                             "stream": True},
                      headers={"traceparent": traceparent}, timeout=60)
    assert resp.status_code == 200 and resp.text.rstrip().endswith("data: [DONE]")
    traced.collector.wait_for(lambda spans: has(("pdserve-decode", "decode"), ("pdserve-decode", "first_step"),
                                                ("pdserve-coordinator", "attempt"))(
        [s for s in spans if s.trace_id == trace_id]))
    spans = traced.collector.trace(trace_id)
    attempt = one(spans, "attempt", "pdserve-coordinator")
    assert attempt.attributes["pdserve.prefill"] == "local"
    assert "prefill" not in children(spans, attempt)
    assert not by_name(spans, "prefill", "pdserve-prefill")
    decode = one(spans, "decode", "pdserve-decode")
    assert decode.parent_span_id == attempt.span_id and decode.attributes["pdserve.local_prefill"] is True
    parts = children(spans, decode)
    assert "first_step" in parts and "kv_transfer" not in parts


def test_the_phase_histogram_counts_every_phase_of_a_request_once(traced):
    before = scrape(traced.url)
    assert chat(traced.url, LONG_PROMPT, client_traceparent()[0]).status_code == 200
    after = scrape(traced.url)
    for phase in ("tokenize", "queue", "route", "decode_admission", "prefill", "prefill_queue", "prefill_forward",
                  "kv_transfer", "first_token", "decode"):
        count, total = (("pdserve_request_phase_seconds_" + part, (("phase", phase),)) for part in ("count", "sum"))
        assert after[count] - before[count] == 1, phase
        assert after[total] > before[total], phase


def test_a_migrated_request_keeps_its_trace_with_an_attempt_per_decode_worker(traced):
    """Last in the module: it kills a decode worker."""
    traceparent, trace_id, _ = client_traceparent()
    body = {"model": "pdserve-tiny", "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": MIGRATED_TOKENS,
            "stream": True}
    with httpx.stream("POST", f"{traced.url}/v1/chat/completions", json=body, headers={"traceparent": traceparent},
                      timeout=60) as resp:
        lines = resp.iter_lines()
        seen = 0
        while seen < 5:
            seen += next(lines).startswith("data: ")
        busy = wait_for(lambda: [d for d in traced.decodes if health(d.address, "decode").num_running],
                        what="the decode worker serving the stream")
        os.kill(busy[0].proc.pid, signal.SIGKILL)
        rest = list(lines)
    assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
    survivor = next(d for d in traced.decodes if d is not busy[0])
    traced.collector.wait_for(lambda spans: len(by_name([s for s in spans if s.trace_id == trace_id], "attempt",
                                                        "pdserve-coordinator")) == 2
                              and has(("pdserve-decode", "decode"))([s for s in spans if s.trace_id == trace_id]))
    spans = traced.collector.trace(trace_id)
    first, second = sorted(by_name(spans, "attempt", "pdserve-coordinator"), key=lambda s: s.start_ns)
    assert first.status_code == 2 and first.attributes["pdserve.decode"] == busy[0].address  # STATUS_CODE_ERROR
    assert second.attributes["pdserve.migration"] is True and second.attributes["pdserve.decode"] == survivor.address
    # The killed worker exported nothing more; the survivor's span hangs from the second attempt, as does the
    # prefill of the prompt plus the tokens already sent.
    decode = one(spans, "decode", "pdserve-decode")
    assert decode.parent_span_id == second.span_id
    assert "prefill" in children(spans, second) and "decode" in children(spans, first)
