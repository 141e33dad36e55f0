"""completion_tokens counts the prefill worker's first token; maxIterTimes caps decode steps."""

from __future__ import annotations

import json

import pytest

from tests.helpers import CLUSTER_MAX_ITER_TIMES, CLUSTER_MAX_SEQ_LEN, sse_events

pytestmark = pytest.mark.system

PROMPT = "The scheduler counts every batch"


def complete(http, stream: bool, **fields) -> dict:
    body = {"model": "pdserve-tiny", "prompt": PROMPT, "temperature": 0, "stream": stream, **fields}
    if not stream:
        resp = http.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        chunks = [json.loads(p) for p in sse_events(resp.read())[:-1]]
    final = chunks[-1]
    final["num_token_chunks"] = len(chunks) - 1
    return final


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_tokens", [None, CLUSTER_MAX_ITER_TIMES + 1, 400])
def test_request_capped_by_max_iter_times_reports_max_iter_times_plus_one(http, stream, max_tokens):
    fields = {} if max_tokens is None else {"max_tokens": max_tokens}
    body = complete(http, stream, **fields)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == CLUSTER_MAX_ITER_TIMES + 1
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + CLUSTER_MAX_ITER_TIMES + 1
    if stream:
        assert body["num_token_chunks"] == CLUSTER_MAX_ITER_TIMES + 1


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_tokens", [1, 2, 7, CLUSTER_MAX_ITER_TIMES])
def test_request_capped_by_its_own_max_tokens_reports_max_tokens(http, stream, max_tokens):
    body = complete(http, stream, max_tokens=max_tokens)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == max_tokens
    if stream:
        assert body["num_token_chunks"] == max_tokens


def test_chat_usage_counts_prompt_from_the_chat_template(http, hf_model):
    messages = [{"role": "user", "content": "Hello!"}]
    resp = http.post("/v1/chat/completions", json={"model": "pdserve-tiny", "messages": messages, "max_tokens": 3})
    body = resp.json()
    _, tokenizer = hf_model
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert body["usage"]["prompt_tokens"] == len(tokenizer(templated, add_special_tokens=False)["input_ids"])
    assert body["usage"]["completion_tokens"] == 3
    assert len(body["decode_time_arr"]) == 2 and body["prefill_time"] > 0


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_that_cannot_fit_in_max_seq_len_is_400_naming_the_limits(http, stream):
    resp = http.post("/v1/completions", json={"model": "pdserve-tiny", "prompt": PROMPT, "stream": stream,
                                              "max_tokens": CLUSTER_MAX_SEQ_LEN})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "max_tokens"
    assert f"maxSeqLen={CLUSTER_MAX_SEQ_LEN}" in error["message"]
    assert complete(http, False, max_tokens=2)["usage"]["completion_tokens"] == 2
