"""The lock-free per-token and per-request figures expose exactly what prometheus_client's metrics would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from coordinator.metrics import LATENCY_BUCKETS, LATENCY_BUCKETS_FINE, LoopHistogram, RequestCollector


def test_loop_histogram_exposition_equals_a_prometheus_client_histogram():
    values = [0.0001, 0.005, 0.0051, 1, 1.0, 2.4, 7, 600, 601, 1e6]
    reference_registry, ours_registry = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("h_seconds", "doc", buckets=LATENCY_BUCKETS, registry=reference_registry)
    ours = LoopHistogram("h_seconds", "doc", LATENCY_BUCKETS)
    ours_registry.register(type("C", (), {"collect": lambda self: [ours.family()]})())
    for v in values:
        reference.observe(v)
        ours.observe(v)

    def lines(registry):
        return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]

    assert lines(ours_registry) == lines(reference_registry)
    assert 'h_seconds_bucket{le="1.0"} 5.0' in lines(ours_registry)


def exposition(registry: CollectorRegistry) -> list[str]:
    return sorted(line for line in generate_latest(registry).decode().splitlines() if "_created" not in line)


def test_request_figures_expose_what_prometheus_client_metrics_would():
    ours = RequestCollector()
    reference = CollectorRegistry()
    received = Counter("pdserve_requests_received_total", "Generation requests received.", ["api"],
                       registry=reference)
    finished = Counter("pdserve_requests_finished_total",
                       "Generation requests finished, by HTTP status ('200' = success).", ["api", "status"],
                       registry=reference)
    running = Gauge("pdserve_requests_running", "Generation requests in flight.", registry=reference)
    e2e = Histogram("pdserve_e2e_request_latency_seconds", "Request latency, arrival to last byte.", ["api"],
                    buckets=LATENCY_BUCKETS, registry=reference)
    prompt_tokens = Counter("pdserve_prompt_tokens_total", "Prompt tokens of finished requests.", registry=reference)
    queue_time = Histogram("pdserve_request_queue_time_seconds",
                           "Time from arrival to leaving the coordinator's queue.", buckets=LATENCY_BUCKETS,
                           registry=reference)
    phases = Histogram("pdserve_request_phase_seconds", ours.phase_seconds.documentation, ["phase"],
                       buckets=LATENCY_BUCKETS_FINE, registry=reference)
    for api, status, seconds in [("openai_chat", "200", 0.2), ("openai_chat", "400", 0.001), ("tgi", "200", 3.0)]:
        received.labels(api).inc()
        ours.received.inc((api,))
        finished.labels(api, status).inc()
        ours.finished.inc((api, status))
        e2e.labels(api).observe(seconds)
        ours.e2e.child((api,)).observe(seconds)
    running.inc()
    ours.running += 1
    prompt_tokens.inc(42)
    ours.prompt_tokens.inc(amount=42)
    queue_time.observe(0.0003)
    ours.queue_time.observe(0.0003)
    for phase, seconds in [("route", 0.00004), ("decode", 1.5), ("route", 0.0002)]:
        phases.labels(phase).observe(seconds)
        ours.phase_seconds.child((phase,)).observe(seconds)
    ours_registry = CollectorRegistry()
    ours_registry.register(ours)
    assert exposition(ours_registry) == exposition(reference)
