"""LoRA adapters through PD: every API selects an adapter its own way, each request's tokens equal PEFT's own model
under that adapter (mixed with the base and other adapters, through PD and local prefill), caches never cross
adapters, and adapters load and unload at run time."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

from tests.helpers import health, management_url, peft_greedy, sse_events

pytestmark = pytest.mark.system

MAX_TOKENS = 8
PROMPTS = ["Once upon a time there was a little server", "The coordinator sends the prompt to", "1 2 3 4 5 6"]
# Long enough for whole 16-position blocks, so the prefix cache has something to hit.
LONG_PROMPT = "the prefill worker computes the cache of every prompt and sends it to the decode worker " * 2


@pytest.fixture(scope="module")
def served(shared_coordinator, lora_adapters):
    """A coordinator over the session cluster's workers serving a1, a2, a3 (PD for every prompt)."""
    return shared_coordinator(loraModules={name: str(path) for name, path in lora_adapters.items()})


@pytest.fixture(scope="module")
def served_locally(shared_coordinator, lora_adapters):
    """The same adapters, every prompt prefilled on the decode worker itself (conditional disaggregation)."""
    return shared_coordinator(sections={"digs_scheduler_config": {"local_prefill_max_tokens": 4096}},
                              loraModules={name: str(path) for name, path in lora_adapters.items()})


@pytest.fixture(scope="module")
def peft_reference(model_dir, lora_adapters, tokenizer):
    """`reference(adapter, prompt)`: PEFT's own greedy tokens (adapter None: the base model)."""
    done = {}

    def reference(adapter: str | None, prompt: str) -> list[int]:
        if (adapter, prompt) not in done:
            done[adapter, prompt] = peft_greedy(model_dir, lora_adapters.get(adapter), tokenizer(prompt)["input_ids"],
                                                MAX_TOKENS)
        return done[adapter, prompt]

    return reference


def completion_ids(url: str, model: str, prompt: str) -> list[int]:
    resp = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                     "temperature": 0, "return_token_ids": True}, timeout=120)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["model"] == model
    return body["choices"][0]["token_ids"]


def mixed(url: str) -> dict[tuple[str, str], list[int]]:
    """Every (model, prompt) of three adapters and the base at once, so their steps share forwards."""
    jobs = [(model, prompt) for model in ("pdserve-tiny", "a1", "a2", "a3") for prompt in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        return dict(zip(jobs, pool.map(lambda job: completion_ids(url, *job), jobs)))


@pytest.mark.parametrize("fixture", ["served", "served_locally"])
def test_three_adapters_and_the_base_at_once_each_equal_peft_greedy_tokens(request, fixture, peft_reference):
    url = request.getfixturevalue(fixture).address
    got = mixed(url)
    for (model, prompt), ids in got.items():
        assert ids == peft_reference(None if model == "pdserve-tiny" else model, prompt), (model, prompt)
    assert got["a1", PROMPTS[0]] != got["pdserve-tiny", PROMPTS[0]]


def test_every_api_selects_the_adapter_its_own_way(served, peft_reference, tokenizer):
    url, prompt = served.address, PROMPTS[0]
    expected = peft_reference("a2", prompt)
    text = tokenizer.decode(expected, skip_special_tokens=True)
    chat = httpx.post(f"{url}/v1/chat/completions", json={
        "model": "a2", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "temperature": 0},
        timeout=60)
    assert chat.status_code == 200 and chat.json()["model"] == "a2"
    tgi = httpx.post(f"{url}/generate", json={"inputs": prompt, "parameters": {
        "adapter_id": "a2", "max_new_tokens": MAX_TOKENS, "details": True}}, timeout=60).json()
    assert [t["id"] for t in tgi["details"]["tokens"]] == expected
    stream = httpx.post(f"{url}/generate_stream", json={"inputs": prompt, "parameters": {
        "adapter_id": "a2", "max_new_tokens": MAX_TOKENS}}, timeout=60)
    assert stream.status_code == 200
    events = [json.loads(p) for p in sse_events(stream.content)]
    assert [i for e in events for i in (e["token"]["id"] if isinstance(e["token"]["id"], list) else [e["token"]["id"]])
            ] == expected
    vllm = httpx.post(f"{url}/generate", json={"prompt": prompt, "model": "a2", "max_tokens": MAX_TOKENS,
                                               "temperature": 0}, timeout=60).json()
    assert vllm["text"][0] == prompt + text
    triton = httpx.post(f"{url}/v2/models/a2/generate", json={"text_input": prompt, "parameters": {
        "max_new_tokens": MAX_TOKENS}}, timeout=60).json()
    assert triton["text_output"] == text and triton["model_name"] == "a2"
    mindie = httpx.post(f"{url}/infer", json={"inputs": prompt, "parameters": {
        "adapter_id": "a2", "max_new_tokens": MAX_TOKENS}}, timeout=60).json()
    assert mindie["generated_text"] == text


def test_models_lists_each_adapter_with_its_parent(served):
    data = httpx.get(f"{served.address}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [
        ("pdserve-tiny", None), ("a1", "pdserve-tiny"), ("a2", "pdserve-tiny"), ("a3", "pdserve-tiny")]


def test_unknown_adapter_is_404_in_each_apis_format_naming_what_is_served(served):
    url = served.address
    openai = httpx.post(f"{url}/v1/completions", json={"model": "a9", "prompt": "x"}, timeout=10)
    assert openai.status_code == 404 and openai.json()["error"]["param"] == "model"
    assert "'a1'" in openai.json()["error"]["message"]
    tgi = httpx.post(f"{url}/generate", json={"inputs": "x", "parameters": {"adapter_id": "a9"}}, timeout=10)
    assert tgi.status_code == 404 and "parameters.adapter_id='a9'" in tgi.json()["error"]
    assert httpx.post(f"{url}/v2/models/a9/generate", json={"text_input": "x"}, timeout=10).status_code == 404


def test_the_same_prompt_under_two_adapters_never_hits_the_others_blocks(served, cluster):
    url = served.address

    def hits() -> int:
        return health(cluster.prefill.address, "prefill").prefix_hit_tokens

    completion_ids(url, "a1", LONG_PROMPT)
    before = hits()
    completion_ids(url, "a3", LONG_PROMPT)  # the same tokens under another adapter: computed again
    assert hits() == before
    completion_ids(url, "a3", LONG_PROMPT)  # under the same adapter again: its blocks are found
    assert hits() > before


def test_adapters_load_and_unload_at_run_time_on_the_management_port(served, lora_adapters, peft_reference):
    manage, url = management_url(served), served.address
    resp = httpx.post(f"{manage}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path":
                                                               str(lora_adapters["a1"])}, timeout=10)
    assert resp.status_code == 200, resp.text
    assert completion_ids(url, "late", PROMPTS[1]) == peft_reference("a1", PROMPTS[1])
    again = httpx.post(f"{manage}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": "/x"}, timeout=10)
    assert again.status_code == 400 and "served already" in again.json()["error"]["message"]
    assert httpx.post(f"{manage}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=10).status_code == 200
    gone = httpx.post(f"{url}/v1/completions", json={"model": "late", "prompt": "x"}, timeout=10)
    assert gone.status_code == 404
    assert httpx.post(f"{manage}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=10).status_code == 404


@pytest.mark.parametrize("path,needle", [
    ("/nonexistent/adapter", "no such adapter folder"),
    ("relative/adapter", "must be an absolute path"),
])
def test_a_folder_that_is_no_adapter_is_a_400_naming_it(served, path, needle):
    resp = httpx.post(f"{management_url(served)}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path},
                      timeout=10)
    assert resp.status_code == 400 and needle in resp.json()["error"]["message"]


def test_a_guided_request_under_an_adapter_follows_the_adapters_own_greedy_path(served, tokenizer):
    # Each adapter's unconstrained greedy text (as served: equal to PEFT's, tested above) is one of the choices:
    # greedy decoding inside the grammar must pick exactly that one under that adapter, the other's under the other.
    prompt = PROMPTS[1]
    texts = {name: tokenizer.decode(completion_ids(served.address, name, prompt)[:4]) for name in ("a1", "a3")}
    assert texts["a1"] != texts["a3"]
    for name, text in texts.items():
        resp = httpx.post(f"{served.address}/v1/completions", timeout=60, json={
            "model": name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "guided_choice": list(texts.values())})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == text


def test_adapters_load_and_unload_under_sixteen_streams_without_failing_one(shared_coordinator, lora_adapters):
    served = shared_coordinator(loraModules={"a1": str(lora_adapters["a1"])})
    manage, url = management_url(served), served.address

    def stream(i: int) -> int:
        body = {"model": "a1" if i % 2 else "pdserve-tiny", "prompt": f"Stream {i} says", "max_tokens": 12,
                "stream": True, "temperature": 0}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
            raw = resp.read()
        assert resp.status_code == 200 and sse_events(raw)[-1] == "[DONE]" and b'"error"' not in raw
        return resp.status_code

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(stream, i) for i in range(16)]
        for name in ("b1", "b2"):
            load = httpx.post(f"{manage}/v1/load_lora_adapter", timeout=30,
                              json={"lora_name": name, "lora_path": str(lora_adapters["a2"])})
            assert load.status_code == 200, load.text
        assert httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "b1", "prompt": "x", "max_tokens": 2}).status_code == 200
        assert httpx.post(f"{manage}/v1/unload_lora_adapter", timeout=30, json={"lora_name": "b1"}).status_code == 200
        assert [f.result() for f in futures] == [200] * 16
    assert httpx.post(f"{url}/v1/completions", timeout=30, json={"model": "b1", "prompt": "x"}).status_code == 404
    assert httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "b2", "prompt": "x", "max_tokens": 2}).status_code == 200
