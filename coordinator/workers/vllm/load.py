"""A vLLM instance's load, read from its Prometheus /metrics as the ReportedLoad a pdserve worker reports.

  vllm:num_requests_running        -> num_running
  vllm:num_requests_waiting        -> num_waiting
  vllm:kv_cache_usage_perc         -> kv_used_tokens (its fraction of the capacity)
  vllm:cache_config_info{kv_cache_size_tokens=...}  -> kv_capacity_tokens (num_gpu_blocks x block_size when absent)
Each is summed over the instance's engines (data-parallel ranks). `load_balance` and `cache_affinity` then
weigh a vLLM instance exactly as a pdserve worker.
"""

from __future__ import annotations

import re

from coordinator.workers.instances import ReportedLoad
from coordinator.workers.client import HealthReport

_LABEL = re.compile(r'(\w+)="([^"]*)"')
_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
_CONFIG = "vllm:cache_config_info"


def _samples(text: str, name: str):
    """(labels text, value) of each sample of family `name` in a Prometheus page that starts with a newline. Found
    with str.find: a vLLM page is ~80 KB, mostly histogram buckets, and a regex tried at every position of it
    cost ten times as much."""
    key = "\n" + name
    at = text.find(key)
    while at >= 0:
        end = text.find("\n", at + 1)
        line = text[at + 1:end if end >= 0 else len(text)]
        rest = line[len(name):]
        if rest[:1] in ("{", " "):  # not a longer name that starts with this one
            labels, _, value = rest.rpartition(" ")
            yield labels, value
        at = text.find(key, at + 1)


def _capacity(labels: dict[str, str]) -> int:
    tokens = labels.get("kv_cache_size_tokens", "")
    if tokens.isdigit():
        return int(tokens)
    blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
    return int(blocks) * int(size) if blocks.isdigit() and size.isdigit() else 0


def health_report(metrics_text: str) -> HealthReport:
    """The load in a vLLM /metrics page (module docstring); a page without vLLM's gauges reads as idle."""
    text = "\n" + metrics_text
    sums = {name: sum(float(value) for _, value in _samples(text, name)) for name in _GAUGES}
    capacities = [_capacity(dict(_LABEL.findall(labels))) for labels, _ in _samples(text, _CONFIG)]
    capacity = sum(capacities)
    # Usage is a fraction per engine; the engines of one instance share a cache configuration.
    per_engine = capacity // len(capacities) if capacities else 0
    used = round(sums["vllm:kv_cache_usage_perc"] * per_engine)
    return HealthReport(ReportedLoad(num_running=int(sums["vllm:num_requests_running"]),
                                     num_waiting=int(sums["vllm:num_requests_waiting"]),
                                     kv_used_tokens=used, kv_capacity_tokens=capacity), draining=False)
