"""Random bodies on every client API (fixed seeds, so a failure replays): never a 5xx, never a hang,
and the server keeps serving. Half the bodies start from a valid request, so the fuzz reaches past
the first check into field rules, sampling options and the workers."""

from __future__ import annotations

import json
import random

import pytest

pytestmark = pytest.mark.system

VALID = {
    "/v1/chat/completions": {"model": "pdserve-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/v1/completions": {"model": "pdserve-tiny", "prompt": "hi", "max_tokens": 3},
    "/generate": {"inputs": "hi", "parameters": {"max_new_tokens": 3}},
    "/generate_stream": {"inputs": "hi", "parameters": {"max_new_tokens": 3}},
    "/": {"inputs": "hi", "parameters": {"max_new_tokens": 3}},
    "/infer": {"inputs": "hi", "parameters": {"max_new_tokens": 3}},
    "/v2/models/pdserve-tiny/generate": {"text_input": "hi", "parameters": {"max_new_tokens": 3}},
    "/v2/models/pdserve-tiny/generate_stream": {"text_input": "hi", "parameters": {"max_new_tokens": 3}},
    "/v2/models/pdserve-tiny/infer": {"inputs": [{"name": "input0", "shape": [1, 2], "datatype": "UINT32",
                                                  "data": [5, 6]}], "outputs": [{"name": "output0"}]},
    "/v1/tokenizer": {"model": "pdserve-tiny", "prompt": "hi"},
}
# Field names of every API, so random bodies hit real fields with wrong values.
FIELDS = sorted({
    "model", "prompt", "messages", "inputs", "text_input", "parameters", "max_tokens", "max_new_tokens",
    "temperature", "top_p", "top_k", "stream", "n", "best_of", "logprobs", "top_logprobs", "stop", "seed", "id",
    "priority", "timeout", "stream_options", "tools", "tool_choice", "details", "do_sample", "repetition_penalty",
    "echo", "min_tokens", "return_token_ids", "content", "role", "type", "text", "image_url", "outputs", "name",
    "shape", "data", "datatype", "presence_penalty", "frequency_penalty", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "include_stop_str_in_output", "max_completion_tokens", "logit_bias",
    "response_format", "truncate", "decoder_input_details", "watermark", "typical_p", "perf_stat", "batch_size",
    "include_usage", "function", "arguments", "tool_calls",
})
SCALARS = [None, True, False, 0, -1, 1, 3, 2**31, 2**63, -2**63, 1e308, -1e-9, 0.5, 1.5, "", "x", "hi",
           "pdserve-tiny", "\u0000", "a" * 300, "1e999", [], {}]


def random_value(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if depth > 3 or roll < 0.45:
        return rng.choice(SCALARS)
    if roll < 0.7:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(FIELDS): random_value(rng, depth + 1) for _ in range(rng.randint(0, 5))}


def random_body(rng: random.Random, path: str) -> dict:
    body = {rng.choice(FIELDS): random_value(rng) for _ in range(rng.randint(0, 6))}
    return {**VALID[path], **body} if rng.random() < 0.5 else body


@pytest.mark.parametrize("seed", range(4))
def test_random_bodies_on_every_api_are_never_a_server_error(http, seed):
    rng = random.Random(seed)
    failures = []
    for _ in range(150):
        path = rng.choice(sorted(VALID))
        body = random_body(rng, path)
        resp = http.post(path, json=body)
        if resp.status_code >= 500:
            failures.append(f"{resp.status_code} {path} {json.dumps(body)[:200]} -> {resp.text[:200]}")
    assert failures == []
    assert http.post("/v1/completions", json=VALID["/v1/completions"]).status_code == 200
