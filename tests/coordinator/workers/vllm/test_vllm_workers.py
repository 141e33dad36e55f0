"""vLLM instances as workers, with real vLLM processes (the CPU build, `make vllm-env`): `pdserve up --engine vllm
--tls` with two prefill and two decode instances over NIXL, mutual TLS and the API key on every link, driven
through every client API and compared with one vLLM instance; then a prefill instance is killed, a decode
instance frozen mid-stream (SIGSTOP) and another killed. The faults come last (file order)."""

from __future__ import annotations

import json
import os
import signal
import ssl
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launcher.vllm_fleet import default_vllm_venv
from tests.helpers import (ServerProcess, cmdline, descendants, management_url, pdserve_argv, peft_greedy,
                           registration_headers, sse_events, wait_for)

pytestmark = [pytest.mark.system, pytest.mark.vllm]

# Long enough that the rebalancing test's 8 streams still run when the instance it froze is healthy again (its health
# check every 2 s): at 400 tokens, vLLM on a quiet machine ended them before that.
MAX_ITER_TIMES = 1200
N = 16
PROMPT = "The capital of France is"
# Over two of vLLM's 128-token CPU blocks: a prefix its cache holds and its KV events announce.
LONG_PROMPT = " ".join(f"item {i} is {i * 7 % 13};" for i in range(60))


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-tls")


@pytest.fixture(scope="module")
def fleet(model_dir, tls_dir, tmp_path_factory, lora_adapters):
    """`pdserve up --engine vllm --tls --prefill 2 --decode 2 --lora a1=... --lora a2=...`."""
    venv = default_vllm_venv()
    if not (venv / "bin" / "python").exists():
        pytest.skip(f"no vLLM environment at {venv}: `make test-vllm` makes it (`make vllm-env`)")
    base = tmp_path_factory.mktemp("vllm") / "base.json"
    base.write_text(json.dumps({
        "model_config": {"modelName": "pdserve-tiny", "maxSeqLen": 2048, "maxInputTokenLen": 1024,
                         "maxIterTimes": MAX_ITER_TIMES},
        # A health check every 2 s brings a resumed instance back; a dead one is found by the requests sent to it.
        "health_config": {"check_interval_s": 2},
        "digs_scheduler_config": {"algorithm_type": "cache_affinity"},
        "exception_config": {"first_token_timeout": 120, "infer_timeout": 300},
        # Moves only where one decode instance holds 4 more streams, and twice as many, as the other: the
        # rebalancing test's, not the spread of the other tests' bursts.
        "rebalance_config": {"enabled": True, "interval_s": 0.5, "min_imbalance": 4, "min_tokens_left": 32},
    }))
    up = ServerProcess(pdserve_argv("up", "--engine", "vllm", "--prefill", "2", "--decode", "2", "--model",
                                    str(model_dir), "--config", str(base), "--predict-port", "0",
                                    "--tls", str(tls_dir), "--lora", f"a1={lora_adapters['a1']}",
                                    "--lora", f"a2={lora_adapters['a2']}"),
                       "pdserve ready:", timeout_s=600)
    try:
        yield up
    finally:
        up.stop(timeout_s=30)


@pytest.fixture(scope="module")
def https(tls_dir) -> httpx.Client:
    """A client of the cluster's CA with its client certificate: every port of the fleet asks for one."""
    context = ssl.create_default_context(cafile=str(tls_dir / "ca.pem"))
    context.load_cert_chain(str(tls_dir / "client.pem"), str(tls_dir / "client-key.pem"))
    with httpx.Client(verify=context, timeout=300) as client:
        yield client


def instances(fleet, https) -> dict[str, list[dict]]:
    return https.get(f"{management_url(fleet)}/v1/instances", headers=registration_headers(fleet)).json()


def vllm_instance(fleet, role: str, index: int = 0) -> dict:
    """One of the fleet's vLLM instances: its port, API key and wrapper process."""
    found = []
    for pid in descendants(fleet.proc.pid):
        args = cmdline(pid).split()
        if "vllm_serve.py" in " ".join(args[:2]) and args[args.index("--role") + 1] == role:
            key = Path(args[args.index("--api-key-file") + 1]).read_text().strip()
            found.append({"pid": pid, "port": int(args[args.index("--port") + 1]), "key": key})
    found.sort(key=lambda i: i["port"])
    return found[index]


def direct(fleet, https, path: str, body: dict) -> dict:
    """The answer of one vLLM instance on its own (a healthy prefill instance: no transfer without
    kv_transfer_params), the reference for pdserve's; https with the client certificate and the API key. `model`
    goes only when it names an adapter (vLLM serves the base model as the folder's path)."""
    healthy = next(i for i in instances(fleet, https)["prefill"] if i["state"] == "healthy")
    instance = vllm_instance_at(fleet, "prefill", healthy["address"])
    if body.get("model") == "pdserve-tiny":
        body = {key: value for key, value in body.items() if key != "model"}
    reply = https.post(f"https://127.0.0.1:{instance['port']}{path}", json=body,
                      headers={"Authorization": f"Bearer {instance['key']}"})
    assert reply.status_code == 200, reply.text
    return reply.json()


def kill_tree(pid: int) -> None:
    """SIGKILL to a vLLM instance: its wrapper, its server, its engine and worker processes at once."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def counter(fleet, https, name: str) -> float:
    text = https.get(f"{fleet.address}/metrics").text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name)


def vllm_instance_at(fleet, role: str, address: str) -> dict:
    port = int(address.rsplit(":", 1)[1])
    return next(vllm_instance(fleet, role, i) for i in (0, 1) if vllm_instance(fleet, role, i)["port"] == port)


def test_greedy_output_through_every_api_matches_one_vllm_instance(fleet, https):
    url = fleet.address
    expected = direct(fleet, https, "/v1/completions", {"prompt": PROMPT, "max_tokens": N, "temperature": 0,
                                                 "ignore_eos": True, "return_token_ids": True})["choices"][0]
    completion = https.post(f"{url}/v1/completions", json={
        "model": "pdserve-tiny", "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["token_ids"] == expected["token_ids"]
    text = expected["text"]
    assert completion.json()["choices"][0]["text"] == text
    stream = https.post(f"{url}/v1/completions", json={
        "model": "pdserve-tiny", "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True,
        "stream": True})
    chunks = [json.loads(e) for e in sse_events(stream.content) if e != "[DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
    tgi = https.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": N, "details": True, "decoder_input_details": False}})
    assert tgi.status_code == 200 and tgi.json()["generated_text"] == text, tgi.text
    assert [t["id"] for t in tgi.json()["details"]["tokens"]] == expected["token_ids"]
    tgi_stream = https.post(f"{url}/generate_stream", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": N}})
    assert json.loads(sse_events(tgi_stream.content)[-1])["generated_text"] == text
    native = https.post(f"{url}/generate", json={"prompt": PROMPT, "max_tokens": N, "temperature": 0})
    assert native.status_code == 200 and native.json()["text"] == [PROMPT + text], native.text
    triton = https.post(f"{url}/v2/models/pdserve-tiny/generate", json={
        "text_input": PROMPT, "parameters": {"max_new_tokens": N}})
    assert triton.status_code == 200 and triton.json()["text_output"] == text, triton.text
    mindie = https.post(f"{url}/infer", json={"inputs": PROMPT, "stream": False,
                                                           "parameters": {"max_new_tokens": N}})
    assert mindie.status_code == 200 and mindie.json()["generated_text"] == text, mindie.text


def test_chat_matches_one_vllm_instance_applying_the_same_template(fleet, https):
    messages = [{"role": "user", "content": "Name three colours."}]
    expected = direct(fleet, https, "/v1/chat/completions", {"messages": messages, "max_tokens": N, "temperature": 0,
                                                      "ignore_eos": True})
    chat = https.post(f"{fleet.address}/v1/chat/completions", json={
        "model": "pdserve-tiny", "messages": messages, "max_tokens": N, "temperature": 0, "ignore_eos": True})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
    assert chat.json()["usage"] == {k: expected["usage"][k] for k in chat.json()["usage"]}


def test_max_iter_times_caps_a_request_at_max_iter_times_plus_one_tokens(fleet, https):
    reply = https.post(f"{fleet.address}/v1/completions", json={
        "model": "pdserve-tiny", "prompt": PROMPT, "max_tokens": MAX_ITER_TIMES + 50, "temperature": 0,
        "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == MAX_ITER_TIMES + 1


def test_sampling_logprobs_and_stops_reach_the_engine(fleet, https):
    expected = direct(fleet, https, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                 "logprobs": 2, "return_tokens_as_token_ids": True,
                                                 "return_token_ids": True})["choices"][0]
    reply = https.post(f"{fleet.address}/v1/completions", json={
        "model": "pdserve-tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2,
        "return_token_ids": True}).json()["choices"][0]
    assert reply["token_ids"] == expected["token_ids"]
    assert reply["logprobs"]["token_logprobs"] == pytest.approx(expected["logprobs"]["token_logprobs"], abs=1e-4)
    assert all(len(top) == 2 for top in reply["logprobs"]["top_logprobs"])
    stop = expected["text"][3:8]
    stopped = https.post(f"{fleet.address}/v1/completions", json={
        "model": "pdserve-tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stop": [stop]}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stop not in stopped["choices"][0]["text"]


def test_sampled_streams_run_without_a_seed_and_a_clients_seed_is_refused_by_name_on_cpu_instances(fleet, https):
    # vLLM's CPU build fails a seeded request whose prompt is chunked, and its engine with it: pdserve sends no seed
    # of its own, and refuses a client's (pdserve up marks its instances device cpu).
    # Under one KV block (128 tokens on CPU): the prefill instances' indexed blocks, which a later test picks the
    # instance to kill by, stay as they were.
    prompt = " ".join(f"note {i} reads {i % 5};" for i in range(12))
    body = {"model": "pdserve-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.9}
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda _: https.post(f"{fleet.address}/v1/completions", json=body), range(8)))
    assert [r.status_code for r in replies] == [200] * 8
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in replies)
    refused = https.post(f"{fleet.address}/v1/completions", json={**body, "seed": 7})
    assert refused.status_code == 400 and "seed=7 with temperature=0.9" in refused.json()["error"]["message"]
    assert https.post(f"{fleet.address}/v1/completions", json={**body, "seed": 7, "temperature": 0}).status_code == 200


@pytest.mark.parametrize("path, body, status", [
    ("/v1/completions", {"model": "pdserve-tiny", "prompt": "hi", "max_tokens": 4, "temperature": 2.5}, 400),
    ("/v1/completions", {"model": "pdserve-tiny", "prompt": "hi", "max_tokens": -1}, 400),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 0}}, 422),
    ("/infer", {"inputs": "hi", "parameters": {"temperature": -1}}, 422),
    ("/v2/models/pdserve-tiny/generate", {"text_input": "hi", "parameters": {"top_p": 7}}, 400),
])
def test_bad_input_is_a_4xx_in_the_apis_own_format(fleet, https, path, body, status):
    reply = https.post(f"{fleet.address}{path}", json=body)
    assert 400 <= reply.status_code < 500, reply.text
    assert "error" in reply.json()
    if path.startswith("/v1/"):
        assert reply.json()["error"]["message"]
    # The fleet serves on: a good request right after.
    assert https.post(f"{fleet.address}/generate", json={
        "inputs": "hi", "parameters": {"max_new_tokens": 2}}).status_code == 200


def test_a_pdserve_worker_cannot_register_beside_vllm_instances(fleet, https):
    reply = https.post(f"{management_url(fleet)}/v1/instances/register", headers=registration_headers(fleet),
                       json={"role": "decode", "address": "127.0.0.1:9"})
    assert reply.status_code == 409 and "vllm" in reply.json()["error"]["message"]


def test_load_comes_from_vllm_metrics_and_blocks_from_its_kv_events(fleet, https):
    body = {"model": "pdserve-tiny", "prompt": LONG_PROMPT, "max_tokens": 2, "temperature": 0}
    assert https.post(f"{fleet.address}/v1/completions", json=body).status_code == 200
    listed = instances(fleet, https)
    for group in listed.values():
        for instance in group:
            assert instance["state"] == "healthy"
            assert instance["reported"]["kv_capacity_tokens"] > 0  # vllm:cache_config_info
    # The prefill instance that ran the prompt announced its blocks; the index holds them in pdserve's hashes.
    wait_for(lambda: any((i.get("kv_index") or {}).get("blocks", 0) >= 2 for i in instances(fleet, https)["prefill"]),
             what="the prefill instance's blocks in the KV index")
    before = counter(fleet, https, "pdserve_instance_expected_cached_tokens_total")
    assert https.post(f"{fleet.address}/v1/completions", json=body).status_code == 200
    assert counter(fleet, https, "pdserve_instance_expected_cached_tokens_total") >= before + 256


def test_lora_adapters_through_pd_equal_peft_and_one_vllm_instance(fleet, https, model_dir, lora_adapters,
                                                                    tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    outputs = {}
    for name in ("a1", "a2"):
        body = {"model": name, "prompt": PROMPT, "max_tokens": N, "temperature": 0, "return_token_ids": True}
        got = https.post(f"{fleet.address}/v1/completions", json=body)
        assert got.status_code == 200, got.text
        assert got.json()["model"] == name
        outputs[name] = got.json()["choices"][0]["token_ids"]
        assert outputs[name] == direct(fleet, https, "/v1/completions", body)["choices"][0]["token_ids"]
        expected = peft_greedy(model_dir, lora_adapters[name], ids, N)
        assert outputs[name] == expected[: len(outputs[name])]  # vLLM stops at EOS; PEFT's generate may pad after
    assert outputs["a1"] != outputs["a2"]
    models = https.get(f"{fleet.address}/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in models][1:] == [("a1", "pdserve-tiny"), ("a2", "pdserve-tiny")]


def test_lora_blocks_from_vllm_kv_events_are_indexed_under_the_adapter(fleet, https):
    body = {"model": "a1", "prompt": LONG_PROMPT + " with an adapter", "max_tokens": 2, "temperature": 0}
    assert https.post(f"{fleet.address}/v1/completions", json=body).status_code == 200
    before = counter(fleet, https, "pdserve_instance_expected_cached_tokens_total")
    wait_for(lambda: https.post(f"{fleet.address}/v1/completions", json=body).status_code == 200 and counter(
        fleet, https, "pdserve_instance_expected_cached_tokens_total") >= before + 256,
             what="the adapter's blocks in the KV index")
    # The same tokens under the other adapter match none of them.
    before = counter(fleet, https, "pdserve_instance_expected_cached_tokens_total")
    assert https.post(f"{fleet.address}/v1/completions", json={**body, "model": "a2"}).status_code == 200
    assert counter(fleet, https, "pdserve_instance_expected_cached_tokens_total") == before


def test_an_adapter_loads_on_every_vllm_instance_at_run_time_and_unloads(fleet, https, lora_adapters):
    manage = management_url(fleet)
    headers = registration_headers(fleet)
    loaded = https.post(f"{manage}/v1/load_lora_adapter", headers=headers,
                        json={"lora_name": "late", "lora_path": str(lora_adapters["a3"])})
    assert loaded.status_code == 200, loaded.text
    body = {"model": "late", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    got = https.post(f"{fleet.address}/v1/completions", json=body)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["token_ids"] == direct(fleet, https, "/v1/completions", body)["choices"][0][
        "token_ids"]
    assert https.post(f"{manage}/v1/unload_lora_adapter", headers=headers, json={"lora_name": "late"}).status_code == 200
    assert https.post(f"{fleet.address}/v1/completions", json=body).status_code == 404


def test_a_killed_prefill_instance_fails_no_request_it_was_routed(fleet, https):
    body = {"model": "pdserve-tiny", "prompt": LONG_PROMPT + " again", "max_tokens": 8, "temperature": 0}
    first = https.post(f"{fleet.address}/v1/completions", json=body)
    assert first.status_code == 200
    # The prefill instance that holds the prompt's blocks is where cache_affinity sends it again: kill it first.
    holder = max(instances(fleet, https)["prefill"], key=lambda i: (i.get("kv_index") or {}).get("blocks", 0))
    victim = vllm_instance_at(fleet, "prefill", holder["address"])
    retries = counter(fleet, https, "pdserve_prefill_retries_total")
    kill_tree(victim["pid"])
    again = https.post(f"{fleet.address}/v1/completions", json=body)
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert counter(fleet, https, "pdserve_prefill_retries_total") >= retries + 1
    assert {i["address"]: i["state"] for i in instances(fleet, https)["prefill"]}[holder["address"]] == "unhealthy"


def stream_and_then(fleet, https, act) -> tuple[str, str]:
    """A long greedy stream through pdserve, `act(decode instance)` called on the vLLM decode instance serving it
    after its 20th token; the stream's text, and one vLLM instance's alone for the same request."""
    body = {"model": "pdserve-tiny", "prompt": PROMPT, "max_tokens": MAX_ITER_TIMES, "temperature": 0,
            "ignore_eos": True, "stream": True}
    expected = direct(fleet, https, "/v1/completions", {**body, "stream": False})["choices"][0]["text"]
    texts: list[str] = []
    acted = False
    with https.stream("POST", f"{fleet.address}/v1/completions", json=body) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            texts.extend(c["text"] for c in json.loads(line[6:])["choices"])
            if not acted and len(texts) >= 20:
                # Waited for, not read once: a stream between two attempts (moved off an instance that failed it)
                # is on no instance for that moment.
                serving = wait_for(lambda: next((i for i in instances(fleet, https)["decode"]
                                                 if i["outstanding_requests"]), None),
                                   timeout_s=60, what="a decode instance holding the stream")
                act(vllm_instance_at(fleet, "decode", serving["address"]))
                acted = True
    assert acted
    return "".join(texts), expected


def test_a_frozen_decode_instance_is_declared_lost_and_its_stream_goes_on_unchanged(fleet, https):
    migrations = counter(fleet, https, "pdserve_request_migrations_total")
    frozen: list[int] = []

    def freeze(instance: dict) -> None:
        frozen.extend([instance["pid"], *descendants(instance["pid"])])
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)

    try:
        text, expected = stream_and_then(fleet, https, freeze)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    assert text == expected
    assert counter(fleet, https, "pdserve_request_migrations_total") >= migrations + 1
    # The silence watch took it out; resumed, it passes a health check and is routed to again.
    wait_for(lambda: all(i["state"] == "healthy" for i in instances(fleet, https)["decode"]), timeout_s=30,
             what="the resumed decode instance healthy again")


def test_streams_crowding_one_decode_instance_move_to_another_that_comes_back_and_finish_unchanged(fleet, https):
    moves = counter(fleet, https, "pdserve_request_rebalances_total")
    bodies = [{"model": "pdserve-tiny", "prompt": f"{PROMPT} {city}", "max_tokens": MAX_ITER_TIMES, "temperature": 0,
               "ignore_eos": True} for city in ("Paris", "Rome", "Oslo", "Bern", "Riga", "Kyiv", "Lima", "Baku")]
    with ThreadPoolExecutor(len(bodies)) as pool:
        expected = list(pool.map(lambda body: direct(fleet, https, "/v1/completions", body)["choices"][0]["text"],
                                 bodies))
    crowded, away = (i["address"] for i in instances(fleet, https)["decode"])
    gone = vllm_instance_at(fleet, "decode", away)
    frozen = [gone["pid"], *descendants(gone["pid"])]

    def states() -> dict[str, str]:
        return {i["address"]: i["state"] for i in instances(fleet, https)["decode"]}

    def load() -> dict[str, int]:
        return {i["address"]: i["outstanding_requests"] for i in instances(fleet, https)["decode"]}

    for pid in frozen:  # out of rotation: its health checks time out
        os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: states()[away] == "unhealthy", timeout_s=60, what="the frozen decode instance out")
        with ThreadPoolExecutor(len(bodies)) as pool:
            replies = [pool.submit(https.post, f"{fleet.address}/v1/completions", json=body) for body in bodies]
            wait_for(lambda: load()[crowded] == len(bodies), timeout_s=60, what="every stream on the other")
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
            frozen = []
            # Back in rotation, it takes streams it was never routed: 8/0 -> 5/3.
            wait_for(lambda: counter(fleet, https, "pdserve_request_rebalances_total") >= moves + 3, timeout_s=60,
                     what="streams moved to the instance that came back")
            texts = [reply.result(timeout=300) for reply in replies]
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    assert [t.status_code for t in texts] == [200] * len(bodies)
    assert [t.json()["choices"][0]["text"] for t in texts] == expected


def test_a_decode_instance_killed_mid_stream_hands_the_stream_on_unchanged(fleet, https):
    migrations = counter(fleet, https, "pdserve_request_migrations_total")
    text, expected = stream_and_then(fleet, https, lambda instance: kill_tree(instance["pid"]))
    assert text == expected
    assert counter(fleet, https, "pdserve_request_migrations_total") >= migrations + 1


def test_a_drained_decode_instance_takes_nothing_new_finishes_its_stream_unchanged_and_serves_again_once_resumed(
        fleet, https):
    # The test before kills a decode instance: `pdserve up` restarts it, and this one needs both.
    wait_for(lambda: all(i["state"] == "healthy" for i in instances(fleet, https)["decode"]), timeout_s=300,
             what="both decode instances healthy")
    drained: list[str] = []

    def drain(instance: dict) -> None:
        address = next(i["address"] for i in instances(fleet, https)["decode"]
                       if i["address"].endswith(f":{instance['port']}"))
        answer = https.post(f"{management_url(fleet)}/v1/instances/drain", headers=registration_headers(fleet),
                            json={"address": address, "drain_timeout_s": 0})
        assert answer.status_code == 200, answer.text
        # A vLLM instance's stream is not moved: it runs to its end where it is.
        assert answer.json()["moved"] == 0 and answer.json()["left"] == 1 and answer.json()["state"] == "draining"
        drained.append(address)
        other = next(i["address"] for i in instances(fleet, https)["decode"] if i["address"] != address)
        served = {i["address"]: i["served"] for i in instances(fleet, https)["decode"]}
        reply = https.post(f"{fleet.address}/v1/completions", json={"model": "pdserve-tiny", "prompt": PROMPT,
                                                                  "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200, reply.text
        after = {i["address"]: i["served"] for i in instances(fleet, https)["decode"]}
        assert after[address] == served[address] and after[other] == served[other] + 1  # out of routing

    text, expected = stream_and_then(fleet, https, drain)
    assert text == expected
    resumed = https.post(f"{management_url(fleet)}/v1/instances/resume", headers=registration_headers(fleet),
                         json={"address": drained[0]})
    assert resumed.status_code == 200 and resumed.json()["state"] == "healthy", resumed.text
