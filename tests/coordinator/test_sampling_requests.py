"""Sampling parameters honoured end to end: seed, top_k, stop strings, fullTextEnabled."""

from __future__ import annotations

import json

import pytest

from tests.helpers import sse_events

pytestmark = pytest.mark.system

BASE = {"model": "pdserve-tiny", "prompt": "Once upon a time", "max_tokens": 10}


def text_of(http, **fields) -> dict:
    resp = http.post("/v1/completions", json={**BASE, **fields})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def test_same_seed_gives_the_same_sampled_text(http):
    a = text_of(http, temperature=1.0, seed=1234)
    b = text_of(http, temperature=1.0, seed=1234)
    assert a["text"] == b["text"]


def test_different_seeds_give_different_sampled_text(http):
    texts = {text_of(http, temperature=1.5, seed=s)["text"] for s in range(1, 6)}
    assert len(texts) > 1


def test_top_k_one_is_greedy(http):
    assert text_of(http, temperature=1.0, top_k=1, seed=9)["text"] == text_of(http, temperature=0)["text"]


def test_tiny_top_p_is_greedy(http):
    assert text_of(http, temperature=1.0, top_p=1e-5, seed=9)["text"] == text_of(http, temperature=0)["text"]


def test_stop_string_cuts_the_output_exactly_before_it(http):
    full = text_of(http, temperature=0)["text"]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    expected = full[: full.index(stop)]
    choice = text_of(http, temperature=0, stop=[stop, "never-appears"])
    assert choice["text"] == expected
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop


def test_streamed_stop_string_never_leaks_even_partially(http):
    full = text_of(http, temperature=0)["text"]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    with http.stream("POST", "/v1/completions", json={**BASE, "temperature": 0, "stop": stop, "stream": True}) as r:
        chunks = [json.loads(p) for p in sse_events(r.read())[:-1]]
    emitted = ""
    for chunk in chunks:
        emitted += chunk["choices"][0]["text"]
        assert stop not in emitted
        assert full.startswith(emitted)
    assert emitted == full[: full.index(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.fixture(scope="module")
def full_text_url(shared_coordinator) -> str:
    return shared_coordinator(fullTextEnabled=True).address


def test_full_text_enabled_streams_cumulative_text_and_full_text_at_the_end(http, full_text_url):
    import httpx

    body = {"model": "pdserve-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
            "temperature": 0}
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    with httpx.Client(base_url=full_text_url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(p) for p in sse_events(r.read())[:-1]]
    contents = [c["choices"][0]["delta"]["content"] for c in chunks]
    for shorter, longer in zip(contents, contents[1:]):
        assert longer.startswith(shorter)
    assert contents[-1] == whole
    assert chunks[-1]["full_text"] == whole


@pytest.mark.parametrize("path,body,text_of", [
    ("/generate_stream", {"inputs": "Hello", "parameters": {"max_new_tokens": 5, "do_sample": False}},
     lambda e: e["token"]["text"] if e["generated_text"] is None else e["generated_text"]),
    ("/infer", {"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": 5, "do_sample": False}},
     lambda e: e["token"]["text"] if e.get("generated_text") is None else e["generated_text"]),
    ("/v2/models/pdserve-tiny/generate_stream",
     {"text_input": "Hello", "parameters": {"max_new_tokens": 5, "do_sample": False}}, lambda e: e["text_output"]),
    ("/v1/completions", {"model": "pdserve-tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0,
                         "stream": True}, lambda e: e["choices"][0]["text"]),
])
def test_full_text_enabled_makes_every_streaming_api_cumulative(full_text_url, path, body, text_of):
    import httpx

    with httpx.Client(base_url=full_text_url, timeout=60) as client:
        with client.stream("POST", path, json=body) as r:
            payloads = [p for p in sse_events(r.read()) if p != "[DONE]"]
    texts = [text_of(json.loads(p)) for p in payloads]
    for shorter, longer in zip(texts, texts[1:]):
        assert longer.startswith(shorter)
    assert len(texts[-1]) >= len(texts[0])


def test_full_text_enabled_makes_the_vllm_stream_cumulative(full_text_url):
    import httpx

    raw = httpx.post(f"{full_text_url}/generate", timeout=60, json={
        "prompt": "Hello", "max_tokens": 5, "temperature": 0, "stream": True}).content
    texts = [json.loads(p)["text"][0] for p in raw[:-1].split(b"\0")]
    for shorter, longer in zip(texts, texts[1:]):
        assert longer.startswith(shorter)
