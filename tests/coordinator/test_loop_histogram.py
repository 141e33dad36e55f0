"""The lock-free per-token histograms expose exactly what prometheus_client's Histogram would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from coordinator.metrics import LATENCY_BUCKETS, LoopHistogram


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
