"""`pdserve up --engine vllm --gateway envoy`: vLLM instances (the CPU build, `make vllm-env`) behind a real Envoy,
the coordinator's endpoint picker and a sidecar for the decode instance. Where the prompt was computed is read from
vLLM's own counters: `vllm:prompt_tokens_total` rises on the instance that computed it, and
`vllm:external_prefix_cache_hits_total` on the decode instance that read it over NIXL."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launcher.gateway_cluster import free_port
from launcher.vllm_fleet import default_vllm_venv
from tests.helpers import ServerProcess, cmdline, coordinator_pid, pdserve_argv, scrape, sse_events, wait_for

pytestmark = [pytest.mark.system, pytest.mark.vllm]

COMPUTED = "vllm:prompt_tokens_total"
READ_OVER_NIXL = "vllm:external_prefix_cache_hits_total"


def long_prompt(tag: str) -> str:
    """A prompt of its own (no instance holds it cached), over two of vLLM's 128-token CPU blocks: blocks its KV
    events announce."""
    return f"{tag}: " + " ".join(f"item {i} is {i * 7 % 13};" for i in range(60))


class VllmGateway:
    """A running `pdserve up --engine vllm --gateway envoy`: Envoy, the coordinator, and its vLLM instances."""

    def __init__(self, up: ServerProcess):
        self.up = up
        self.envoy = up.address
        args = cmdline(coordinator_pid(up)).split()
        self.config_file = Path(args[args.index("--config") + 1])
        self.config = json.loads(self.config_file.read_text())
        http = self.config["http_config"]
        self.coordinator = f"http://127.0.0.1:{http['predict_port']}"
        self.management = f"http://127.0.0.1:{http['manage_port']}"
        auth = self.config["auth_config"]
        self.proof = {"Authorization": f"Bearer {Path(auth['registration_token_file']).read_text().strip()}"}
        self.worker_key = {"Authorization": f"Bearer {Path(auth['worker_secret_file']).read_text().strip()}"}
        self.prefill = self.config["instances"]["prefill"][0]["url"]
        self.decode = self.config["instances"]["decode"][0]["url"]

    def sidecars(self) -> list[str]:
        listed = httpx.get(f"{self.management}/v1/sidecars", headers=self.proof, timeout=10).json()["sidecars"]
        return sorted(s["endpoint"] for s in listed if s["live"])

    def counts(self) -> dict[tuple[str, str], float]:
        """vLLM's prompt counters of both instances, by (instance URL, counter)."""
        found = {}
        for url in (self.prefill, self.decode):
            text = httpx.get(f"{url}/metrics", headers=self.worker_key, timeout=10).text
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name in (COMPUTED, READ_OVER_NIXL):
                        found[url, sample.name] = found.get((url, sample.name), 0.0) + sample.value
        return found

    def rises(self, send) -> tuple[httpx.Response, dict[tuple[str, str], float]]:
        """`send()`'s response and how much each of vLLM's prompt counters rose meanwhile."""
        before = self.counts()
        resp = send()
        after = self.counts()
        return resp, {key: after[key] - before[key] for key in after}


@pytest.fixture(scope="module")
def gateway(model_dir, tmp_path_factory):
    venv = default_vllm_venv()
    if not (venv / "bin" / "python").exists():
        pytest.skip(f"no vLLM environment at {venv}: `make test-vllm` makes it (`make vllm-env`)")
    config = tmp_path_factory.mktemp("vllm-gateway") / "ms_coordinator.json"
    # cache_affinity: the picker routes on the KV index fed by vLLM's KV events.
    config.write_text(json.dumps({"digs_scheduler_config": {"algorithm_type": "cache_affinity",
                                                            "local_prefill_max_tokens": 0},
                                  "exception_config": {"first_token_timeout": 120, "infer_timeout": 300}}))
    up = ServerProcess(pdserve_argv("up", "--engine", "vllm", "--gateway", "envoy", "--prefill", "1", "--decode",
                                    "1", "--model", str(model_dir), "--config", str(config)),
                       "pdserve ready:", timeout_s=600, fork=False)
    try:
        yield VllmGateway(up)
    finally:
        up.stop(timeout_s=60)


def completion(url: str, prompt: str, headers: dict | None = None, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=headers or {}, timeout=120, json={
        "model": "pdserve-tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, **extra})


def _normalized(raw: bytes) -> list[str]:
    """A stream's events with the parts every request has its own of (id, created) blanked."""
    return [re.sub(r'"(id|created)":("[^"]*"|\d+)', r'"\1":_', event) for event in sse_events(raw)]


def test_greedy_streams_through_envoy_are_the_coordinators_event_for_event(gateway):
    bodies = {"/v1/completions": {"prompt": "The capital of France is"},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "Tell me a story"}]}}
    for path, body in bodies.items():
        body = {"model": "pdserve-tiny", **body, "max_tokens": 16, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        streams = []
        for url in (gateway.envoy, gateway.coordinator):
            with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as resp:
                assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
                streams.append(b"".join(resp.iter_raw()))
        assert _normalized(streams[0]) == _normalized(streams[1]), path
        assert len(sse_events(streams[0])) > 3 and streams[0].endswith(b"data: [DONE]\n\n")


def test_the_prompt_is_computed_on_the_prefill_instance_the_picker_named_and_read_over_nixl(gateway):
    prompt = long_prompt("named")
    resp, rose = gateway.rises(lambda: completion(gateway.envoy, prompt))
    assert resp.status_code == 200, resp.text
    tokens = resp.json()["usage"]["prompt_tokens"]
    assert tokens > 256
    assert rose[gateway.prefill, COMPUTED] == tokens
    assert rose[gateway.decode, READ_OVER_NIXL] == tokens  # every prompt token came over NIXL, none computed there
    assert resp.json()["choices"][0]["text"] == completion(gateway.coordinator, prompt).json()["choices"][0]["text"]
    # The picker's KV index learned both instances' blocks from vLLM's KV events.
    for role, url in (("prefill", gateway.prefill), ("decode", gateway.decode)):
        blocks = ("pdserve_instance_kv_index_blocks", (("address", url.split("//")[1]), ("medium", "pool"),
                                                       ("role", role)))
        wait_for(lambda: scrape(gateway.coordinator).get(blocks, 0) >= 2, 30, f"the {role} instance's KV events")


def test_a_sidecar_knowing_no_prefill_instance_prefills_where_the_header_says_else_on_its_decode_instance(
        gateway, tmp_path):
    # As a Kubernetes decode pod's sidecar runs: only its decode instance is listed.
    config = {**gateway.config, "instances": {"prefill": [], "decode": gateway.config["instances"]["decode"]}}
    (tmp_path / "sidecar.json").write_text(json.dumps(config))
    sidecar = ServerProcess(pdserve_argv("sidecar", "--config", str(tmp_path / "sidecar.json"), "--decode",
                                         gateway.decode.split("//")[1], "--port", str(free_port())),
                            "pdserve coordinator ready:", timeout_s=120, fork=False)
    try:
        named = {"x-prefiller-host-port": gateway.prefill.split("//")[1]}
        resp, rose = gateway.rises(lambda: completion(sidecar.address, long_prompt("header"), named))
        assert resp.status_code == 200, resp.text
        tokens = resp.json()["usage"]["prompt_tokens"]
        assert rose[gateway.prefill, COMPUTED] == tokens and rose[gateway.decode, READ_OVER_NIXL] == tokens

        resp, rose = gateway.rises(lambda: completion(sidecar.address, long_prompt("alone")))
        assert resp.status_code == 200, resp.text
        tokens = resp.json()["usage"]["prompt_tokens"]
        assert rose[gateway.prefill, COMPUTED] == 0 and rose[gateway.decode, READ_OVER_NIXL] == 0
        assert rose[gateway.decode, COMPUTED] == tokens
        reference = completion(gateway.coordinator, long_prompt("alone")).json()["choices"][0]["text"]
        assert resp.json()["choices"][0]["text"] == reference
    finally:
        sidecar.stop(timeout_s=30)


def test_a_subset_hint_naming_the_sidecar_is_served_and_one_naming_none_is_a_503(gateway):
    [sidecar] = gateway.sidecars()
    resp = completion(gateway.envoy, "Hello there", {"x-gateway-destination-endpoint-subset": sidecar})
    assert resp.status_code == 200, resp.text
    resp = completion(gateway.envoy, "Hello there", {"x-gateway-destination-endpoint-subset": "127.0.0.1:1"})
    assert resp.status_code == 503
    assert "subset hint" in resp.json()["error"]["message"]
