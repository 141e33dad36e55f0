"""The Gateway API Inference Extension's metric names, beside pdserve's own: what a GIE dashboard reads of an EPP."""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

from coordinator.metrics import LoopCounter, LoopHistogram
from coordinator.workers.instances import InstanceRegistry

DURATION_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30,
                    45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600)
PICK_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


class GatewayMetrics:
    """inference_objective_* per model, inference_pool_* of the decode pool, and the picker's own pick time."""

    def __init__(self, pool_name: str, registry: InstanceRegistry, sidecars):
        self.pool = pool_name
        self.registry = registry
        self.sidecars = sidecars
        labels = ("model_name", "target_model_name")
        self.requests = LoopCounter("inference_objective_request_total", "Requests picked an endpoint for, by "
                                    "model.", labels)
        self.errors = LoopCounter("inference_objective_request_error_total", "Requests refused by the picker, by "
                                  "model and HTTP status.", (*labels, "error_code"))
        self.duration = LoopHistogram("inference_objective_request_duration_seconds", "Seconds from the pick to "
                                      "the end of the request's ext_proc stream.", DURATION_BUCKETS, labels)
        self.pick_time = LoopHistogram("pdserve_epp_pick_seconds", "Seconds from a request's ext_proc stream "
                                       "opening to its endpoint chosen (body read included).", PICK_BUCKETS)

    def picked(self, model: str) -> None:
        self.requests.inc((model, model))

    def refused(self, model: str, status: int) -> None:
        self.errors.inc((model, model, str(status)))

    def finished(self, model: str, seconds: float) -> None:
        self.duration.child((model, model)).observe(seconds)

    def collect(self):
        ready = [i for i in self.registry.pool("decode")
                 if i.available and not i.held and self.sidecars.endpoint_of(i.address) is not None]
        kv = GaugeMetricFamily("inference_pool_average_kv_cache_utilization", "Mean KV cache use (0-1) of the "
                               "pool's ready decode workers.", labels=["name"])
        queue = GaugeMetricFamily("inference_pool_average_queue_size", "Mean requests waiting on the pool's ready "
                                  "decode workers.", labels=["name"])
        pods = GaugeMetricFamily("inference_pool_ready_pods", "Decode workers with a sidecar the picker may "
                                 "choose.", labels=["name"])
        count = len(ready) or 1
        kv.add_metric([self.pool], sum(i.reported.kv_usage for i in ready) / count)
        queue.add_metric([self.pool], sum(i.reported.num_waiting for i in ready) / count)
        pods.add_metric([self.pool], len(ready))
        return [self.requests.family(), self.errors.family(), self.duration.family(), self.pick_time.family(),
                kv, queue, pods]
