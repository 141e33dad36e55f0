"""vLLM's native /generate and the /v1/tokenizer endpoint."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.system


def test_vllm_generate_returns_the_prompt_and_its_continuation(http):
    whole = http.post("/v1/completions", json={"model": "pdserve-tiny", "prompt": "My name is", "max_tokens": 5,
                                               "temperature": 0}).json()["choices"][0]["text"]
    resp = http.post("/generate", json={"prompt": "My name is", "max_tokens": 5, "temperature": 0})
    assert resp.status_code == 200
    assert resp.json() == {"text": ["My name is" + whole]}


def test_vllm_stream_writes_one_object_per_token_each_ending_in_nul(http):
    resp = http.post("/generate", json={"prompt": "My name is", "max_tokens": 5, "temperature": 0, "stream": True})
    assert resp.status_code == 200
    # NUL-separated objects are not one JSON document, so the stream does not claim to be JSON.
    assert resp.headers["content-type"].startswith("application/octet-stream")
    raw = resp.content
    assert raw.endswith(b"\0")
    parts = raw[:-1].split(b"\0")
    assert len(parts) == 5
    texts = [json.loads(p)["text"][0] for p in parts]
    whole = http.post("/generate", json={"prompt": "My name is", "max_tokens": 5, "temperature": 0}).json()
    assert "My name is" + "".join(texts) == whole["text"][0]


@pytest.mark.parametrize("body,needle", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "repetition_penalty": 3}, "repetition_penalty"),
    ({"prompt": "", "max_tokens": 2}, "prompt"),
    ({"prompt": "x", "n": 2}, "n: unknown field"),
])
def test_vllm_bad_input_is_400_naming_the_field(http, body, needle):
    resp = http.post("/generate", json=body)
    assert resp.status_code == 400 and needle in resp.json()["error"]


def test_vllm_unknown_lora_id_is_404_naming_what_is_served(http):
    resp = http.post("/generate", json={"prompt": "x", "model": "some-lora"})
    assert resp.status_code == 404
    assert "model='some-lora': no such model or LoRA adapter" in resp.json()["error"]
    assert "pdserve-tiny" in resp.json()["error"]


def test_tokenizer_counts_and_lists_tokens(http, hf_model):
    _, tokenizer = hf_model
    resp = http.post("/v1/tokenizer", json={"inputs": "what is your name?"})
    assert resp.status_code == 200
    body = resp.json()
    ids = tokenizer("what is your name?")["input_ids"]
    assert body["token_number"] == len(ids) == len(body["tokens"])
    assert "".join(body["tokens"]) == "what is your name?"


def test_tokenizer_rejects_empty_and_missing_inputs(http):
    assert http.post("/v1/tokenizer", json={"inputs": ""}).status_code == 400
    assert http.post("/v1/tokenizer", json={}).status_code == 400
