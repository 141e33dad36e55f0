"""A vLLM instance's /metrics page read as the load a pdserve worker reports."""

from __future__ import annotations

from coordinator.workers.vllm.load import health_report

PAGE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 9.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:cache_config_info{block_size="128",engine="0",kv_cache_size_tokens="1000",num_gpu_blocks="8"} 1.0
vllm:cache_config_info{block_size="128",engine="1",kv_cache_size_tokens="1000",num_gpu_blocks="8"} 1.0
"""


def test_running_waiting_and_kv_usage_sum_over_the_engines():
    report = health_report(PAGE)
    load = report.load
    assert (load.num_running, load.num_waiting) == (4, 2)
    assert load.kv_capacity_tokens == 2000 and load.kv_used_tokens == 750
    assert report.draining is False


def test_capacity_falls_back_to_blocks_times_block_size():
    load = health_report('vllm:cache_config_info{block_size="16",num_gpu_blocks="10"} 1.0\n'
                         'vllm:kv_cache_usage_perc{engine="0"} 0.5\n').load
    assert (load.kv_capacity_tokens, load.kv_used_tokens) == (160, 80)


def test_a_page_without_vllms_gauges_reads_as_idle():
    load = health_report("process_cpu_seconds_total 3.0\n").load
    assert (load.num_running, load.num_waiting, load.kv_capacity_tokens) == (0, 0, 0)
