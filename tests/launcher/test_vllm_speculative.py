"""`pdserve up --engine vllm --speculative ngram` with real vLLM processes (the CPU build, `make vllm-env`): the
decode instance (a NIXL kv_consumer) drafts by vLLM's ngram speculative decoding, greedy output stays that of an
instance without it, and vLLM's spec_decode counters show the drafts."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launcher.vllm_fleet import default_vllm_venv
from tests.helpers import ServerProcess, cmdline, descendants, pdserve_argv

pytestmark = [pytest.mark.system, pytest.mark.vllm]

# Repeats itself, so that the text's last tokens were seen before (what ngram drafts from).
PROMPTS = ["one two three four five six, one two three four five six, one two three",
           "\n".join(f"item = items[{i}]  # item {i} of the list" for i in range(8))]


def instance(up: ServerProcess, role: str) -> tuple[str, dict]:
    """A vLLM instance of `up`: its base URL and the API key it asks for."""
    for pid in descendants(up.proc.pid):
        args = cmdline(pid).split()
        if "vllm_serve.py" in " ".join(args[:2]) and args[args.index("--role") + 1] == role:
            key = Path(args[args.index("--api-key-file") + 1]).read_text().strip()
            return f"http://127.0.0.1:{args[args.index('--port') + 1]}", {"Authorization": f"Bearer {key}"}
    raise AssertionError(f"no {role} instance")


def test_ngram_on_the_decode_instance_keeps_greedy_output_and_vllm_counts_its_drafts(model_dir, tmp_path):
    if not (default_vllm_venv() / "bin" / "python").exists():
        pytest.skip(f"no vLLM environment at {default_vllm_venv()}: `make test-vllm` makes it (`make vllm-env`)")
    config = tmp_path / "ms_coordinator.json"
    config.write_text(json.dumps({"model_config": {"modelName": "pdserve-tiny", "maxSeqLen": 2048},
                                  "exception_config": {"first_token_timeout": 120, "infer_timeout": 300}}))
    up = ServerProcess(pdserve_argv("up", "--engine", "vllm", "--speculative", "ngram", "--model", str(model_dir),
                                    "--config", str(config), "--predict-port", "0"), "pdserve ready:", timeout_s=600)
    try:
        prefill_url, prefill_key = instance(up, "prefill")  # drafts nothing: the reference
        decode_url, decode_key = instance(up, "decode")
        assert '"method": "ngram"' in cmdline(next(p for p in descendants(up.proc.pid)
                                                   if "--role decode" in cmdline(p) and "vllm_serve.py" in cmdline(p)))
        with httpx.Client(timeout=300) as client:
            for prompt in PROMPTS:
                body = {"prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                        "return_token_ids": True}
                expected = client.post(f"{prefill_url}/v1/completions", json=body, headers=prefill_key)
                got = client.post(f"{up.address}/v1/completions", json={"model": "pdserve-tiny", **body})
                assert got.status_code == 200, got.text
                assert got.json()["choices"][0]["token_ids"] == expected.json()["choices"][0]["token_ids"]
            metrics = client.get(f"{decode_url}/metrics", headers=decode_key).text
        counted = {sample.name: sample.value for family in text_string_to_metric_families(metrics)
                   for sample in family.samples if sample.name.startswith("vllm:spec_decode_num_")}
        assert counted["vllm:spec_decode_num_drafts_total"] > 0, counted
        assert counted["vllm:spec_decode_num_draft_tokens_total"] >= counted["vllm:spec_decode_num_drafts_total"]
    finally:
        up.stop(timeout_s=30)
