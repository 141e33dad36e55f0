"""Tokens through coordinator -> prefill -> gRPC KV -> decode equal model.generate in this process."""

from __future__ import annotations

import json

import pytest

from tests.helpers import GREEDY_PROMPTS, reference_tokens, sse_events

pytestmark = pytest.mark.system

MAX_TOKENS = 10


@pytest.mark.parametrize("prompt", GREEDY_PROMPTS)
def test_completion_tokens_match_local_greedy_generate(http, hf_model, prompt):
    resp = http.post("/v1/completions", json={
        "model": "pdserve-tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "return_token_ids": True,
    })
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    _, tokenizer = hf_model
    assert choice["prompt_token_ids"] == tokenizer(prompt)["input_ids"]
    expected = reference_tokens(hf_model, choice["prompt_token_ids"], MAX_TOKENS)
    assert choice["token_ids"] == expected
    assert choice["text"] == tokenizer.decode(expected, skip_special_tokens=True)


def test_streamed_chat_tokens_match_local_greedy_generate(http, hf_model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a joke about cats."}]
    body = {"model": "pdserve-tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "return_token_ids": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        payloads = sse_events(resp.read())
    chunks = [json.loads(p) for p in payloads[:-1]]
    prompt_ids = chunks[0]["prompt_token_ids"]
    streamed = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    _, tokenizer = hf_model
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt_ids == tokenizer(templated, add_special_tokens=False)["input_ids"]
    assert streamed == reference_tokens(hf_model, prompt_ids, MAX_TOKENS)
