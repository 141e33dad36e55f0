"""`pdserve up --gateway envoy --tls`: the local cluster behind a real Envoy, its endpoint picker and a sidecar per
decode worker, as a Gateway API inference gateway runs it; mutual TLS on every link (clients to Envoy, Envoy to the
picker and to the sidecars)."""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from security.api_keys import hash_key
from tests.helpers import (ServerProcess, cmdline, coordinator_pid, descendants, pdserve_argv, sse_events, wait_for,
                           write_api_keys)

pytestmark = [pytest.mark.system, pytest.mark.long]

OPEN = {"Authorization": "Bearer open-key"}
TIGHT = {"Authorization": "Bearer tight-key"}


class Gateway:
    """A running `pdserve up --gateway envoy --tls`, the addresses behind Envoy, and a client of the cluster's CA."""

    def __init__(self, up: ServerProcess, client: httpx.Client, tls_dir: Path):
        self.up = up
        self.client = client
        self.tls_dir = tls_dir
        self.envoy = up.address
        args = cmdline(coordinator_pid(up)).split()
        self.config = json.loads(Path(args[args.index("--config") + 1]).read_text())
        http = self.config["http_config"]
        self.coordinator = f"https://127.0.0.1:{http['predict_port']}"
        self.management = f"https://127.0.0.1:{http['manage_port']}"
        token = Path(self.config["auth_config"]["registration_token_file"]).read_text().strip()
        self.proof = {"Authorization": f"Bearer {token}"}

    def scrape(self, url: str) -> dict[tuple, float]:
        values = {}
        for family in text_string_to_metric_families(self.client.get(f"{url}/metrics").text):
            for sample in family.samples:
                values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return values

    def received(self, sidecar: str) -> float:
        """Generation requests the sidecar at `sidecar` received, from its own /metrics."""
        return sum(v for (name, _), v in self.scrape(f"https://{sidecar}").items()
                   if name == "pdserve_requests_received_total")

    def sidecars(self) -> list[str]:
        listed = self.client.get(f"{self.management}/v1/sidecars", headers=self.proof).json()["sidecars"]
        return sorted(s["endpoint"] for s in listed if s["live"])

    def served_by(self, send) -> tuple[httpx.Response, str]:
        """`send()`'s response and the sidecar that served it (whose request count rose)."""
        before = {s: self.received(s) for s in self.sidecars()}
        resp = send()
        rose = [s for s, count in before.items() if self.received(s) > count]
        assert len(rose) == 1, rose
        return resp, rose[0]

    def completion(self, url: str, prompt: str, headers: dict | None = None, **extra) -> httpx.Response:
        return self.client.post(f"{url}/v1/completions", headers={**OPEN, **(headers or {})}, json={
            "model": "pdserve-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra})


@pytest.fixture(scope="module")
def gateway(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gateway")
    keys = write_api_keys(folder / "keys", ["open-key"])
    keys.write_text(keys.read_text() + f"{hash_key('tight-key')} name=tight concurrency=1\n")
    config = folder / "ms_coordinator.json"
    config.write_text(json.dumps({"digs_scheduler_config": {"algorithm_type": "cache_affinity",
                                                            "local_prefill_max_tokens": 0}}))
    tls_dir = folder / "tls"
    up = ServerProcess(pdserve_argv("up", "--gateway", "envoy", "--decode", "2", "--model", str(model_dir),
                                    "--config", str(config), "--api-keys", str(keys), "--tls", str(tls_dir)),
                       "pdserve ready:", timeout_s=240, fork=False)
    context = ssl.create_default_context(cafile=str(tls_dir / "ca.pem"))
    context.load_cert_chain(str(tls_dir / "client.pem"), str(tls_dir / "client-key.pem"))
    try:
        with httpx.Client(verify=context, timeout=120) as client:
            yield Gateway(up, client, tls_dir)
    finally:
        up.stop(timeout_s=60)


def test_up_prints_envoys_listener_and_runs_a_sidecar_per_decode_worker_and_envoy(gateway):
    lines = [cmdline(p) for p in descendants(gateway.up.proc.pid)]
    assert sum(" sidecar --config " in c for c in lines) == 2
    assert sum("launcher.gateway_cluster" in c for c in lines) == 1
    assert gateway.envoy not in (gateway.coordinator,) and len(gateway.sidecars()) == 2


def test_a_request_through_envoy_is_served_by_a_sidecar_as_the_coordinator_serves_it(gateway):
    through, _ = gateway.served_by(lambda: gateway.completion(gateway.envoy, "The coordinator sends the prompt"))
    direct = gateway.completion(gateway.coordinator, "The coordinator sends the prompt")
    assert through.status_code == 200, through.text
    assert "x-gateway-destination-endpoint-served" not in through.headers  # sidecar addresses stay inside
    assert through.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
    metrics = gateway.scrape(gateway.coordinator)
    assert metrics[("inference_objective_request_total", (("model_name", "pdserve-tiny"),
                                                          ("target_model_name", "pdserve-tiny")))] >= 1
    assert metrics[("inference_pool_ready_pods", (("name", "pdserve"),))] == 2


def test_a_subset_hint_sends_the_request_to_that_sidecar_and_one_naming_none_is_a_503(gateway):
    for sidecar in gateway.sidecars():
        for _ in range(2):
            resp, served = gateway.served_by(lambda: gateway.completion(
                gateway.envoy, "Hello there", {"x-gateway-destination-endpoint-subset": sidecar}))
            assert resp.status_code == 200 and served == sidecar
    resp = gateway.completion(gateway.envoy, "Hello there", {"x-gateway-destination-endpoint-subset": "127.0.0.1:1"})
    assert resp.status_code == 503
    assert "subset hint" in resp.json()["error"]["message"]


def _normalized(raw: bytes) -> list[str]:
    """A stream's events with the parts every request has its own of (id, created) blanked."""
    return [re.sub(r'"(id|created)":("[^"]*"|\d+)', r'"\1":_', event) for event in sse_events(raw)]


def test_sse_streams_through_envoy_are_byte_identical_to_the_coordinators(gateway):
    body = {"model": "pdserve-tiny", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 12,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    streams = []
    for url in (gateway.envoy, gateway.coordinator):
        with gateway.client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=OPEN) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            streams.append(b"".join(resp.iter_raw()))
    assert _normalized(streams[0]) == _normalized(streams[1])
    assert streams[0].endswith(b"data: [DONE]\n\n")


def test_a_220_kb_prompt_arrives_intact(gateway):
    text = "".join(f"line {i}: the gateway must pass every byte of a long prompt.\n" for i in range(3700))
    assert len(text.encode()) > 220_000
    answers = [gateway.client.post(f"{url}/v1/tokenizer", json={"inputs": text}, headers=OPEN)
               for url in (gateway.envoy, gateway.coordinator)]
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[0].json() == answers[1].json() and answers[0].json()["token_number"] > 40_000


def test_a_conversations_turns_stay_on_the_decode_worker_holding_their_prefix(gateway):
    for conversation in range(3):
        messages = [{"role": "system", "content": f"Conversation {conversation}: " + "you answer briefly. " * 30}]
        served = []
        for turn in range(3):
            messages.append({"role": "user", "content": f"Question {turn} of conversation {conversation}?"})
            resp, sidecar = gateway.served_by(lambda: gateway.client.post(
                f"{gateway.envoy}/v1/chat/completions", headers=OPEN,
                json={"model": "pdserve-tiny", "messages": messages, "max_tokens": 6, "temperature": 0}))
            assert resp.status_code == 200, resp.text
            served.append(sidecar)
            messages.append({"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]})
        assert len(set(served)) == 1, served


def test_a_tenant_past_its_concurrency_gets_a_429_from_envoy_while_its_stream_runs(gateway):
    tenant = ("pdserve_tenant_requests_in_flight", (("tenant", "tight"),))
    first: dict = {}

    def stream():
        with gateway.client.stream("POST", f"{gateway.envoy}/v1/completions", headers=TIGHT, json={
                "model": "pdserve-tiny", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                "stream": True}) as resp:
            first["status"] = resp.status_code
            first["raw"] = b"".join(resp.iter_raw())

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        wait_for(lambda: gateway.scrape(gateway.coordinator).get(tenant) == 1, 60, "the tight tenant's stream in flight")
        refused = gateway.completion(gateway.envoy, "Hello there", TIGHT)
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error" and "tenant tight" in refused.text
    finally:
        reader.join(120)
    assert first["status"] == 200 and first["raw"].endswith(b"data: [DONE]\n\n")
    wait_for(lambda: gateway.scrape(gateway.coordinator).get(tenant) == 0, 30, "the tight tenant's stream closed")
    assert gateway.completion(gateway.envoy, "Hello there", TIGHT).status_code == 200


def test_the_model_rewrite_header_serves_a_request_under_the_models_name(gateway):
    assert gateway.completion(gateway.envoy, "Hello there", model="my-alias").status_code == 404
    resp = gateway.completion(gateway.envoy, "Hello there", {"x-llm-d-model-name-rewrite": "pdserve-tiny"}, model="my-alias")
    assert resp.status_code == 200, resp.text


def test_a_bad_api_key_is_refused_by_the_picker_with_a_401(gateway):
    resp = gateway.completion(gateway.envoy, "Hello there", {"Authorization": "Bearer wrong"})
    assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"


def test_requests_keep_being_served_while_a_sidecar_is_killed_and_restarted(gateway):
    victim = next(p for p in descendants(gateway.up.proc.pid) if " sidecar --config " in cmdline(p))
    os.kill(victim, signal.SIGKILL)
    for i in range(6):  # the picker still names the dead sidecar first at times: Envoy tries the fallback
        resp = gateway.completion(gateway.envoy, f"Request {i} while a sidecar is down")
        assert resp.status_code == 200, resp.text
    wait_for(lambda: len(gateway.sidecars()) == 2 and sum(" sidecar --config " in cmdline(p)
                                                             for p in descendants(gateway.up.proc.pid)) == 2,
             60, "the sidecar restarted and announced")


def test_envoy_takes_only_clients_of_the_clusters_ca_and_every_link_is_mutual_tls(gateway):
    assert gateway.envoy.startswith("https://")
    with pytest.raises(httpx.TransportError):  # no client certificate: refused in the handshake
        httpx.post(f"{gateway.envoy}/v1/completions", timeout=30, json={"model": "pdserve-tiny", "prompt": "Hi"},
                   verify=ssl.create_default_context(cafile=str(gateway.tls_dir / "ca.pem")))
    tls = gateway.config["tls_config"]
    assert tls["epp"]["mutual_tls"] and tls["predict"]["mutual_tls"] and tls["registration"]["tls_enable"]
