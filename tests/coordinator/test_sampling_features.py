"""Logprobs, stop tokens and min_tokens end to end, checked against the model in this process."""

from __future__ import annotations

import pytest

import json

import openai
import torch

from tests.helpers import sse_events

pytestmark = pytest.mark.system

PROMPT = "Once upon a time"


def greedy(http, **fields) -> dict:
    resp = http.post("/v1/completions", json={"model": "pdserve-tiny", "prompt": PROMPT, "max_tokens": 8,
                                              "temperature": 0, "return_token_ids": True, **fields})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def test_completion_logprobs_equal_log_softmax_of_the_models_logits(http, hf_model):
    model, tokenizer = hf_model
    choice = greedy(http, logprobs=3)
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    lp = choice["logprobs"]
    n = len(choice["prompt_token_ids"])
    assert len(lp["tokens"]) == len(choice["token_ids"]) == 8
    for i, token in enumerate(choice["token_ids"]):
        row = ref[n - 1 + i]
        assert abs(lp["token_logprobs"][i] - float(row[token])) < 1e-4
        assert lp["tokens"][i] == tokenizer.decode([token])
        top_ids = torch.topk(row, 3).indices.tolist()
        assert list(lp["top_logprobs"][i]) == [tokenizer.decode([t]) for t in top_ids]
        for t in top_ids:
            assert abs(lp["top_logprobs"][i][tokenizer.decode([t])] - float(row[t])) < 1e-4
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_streamed_completion_logprobs_match_non_stream(http):
    whole = greedy(http, logprobs=1)["logprobs"]
    body = {"model": "pdserve-tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 1,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(p) for p in sse_events(r.read())[:-1]]
    streamed = [c["choices"][0]["logprobs"]["token_logprobs"][0] for c in chunks[:-1]]
    assert streamed == whole["token_logprobs"]


def test_chat_logprobs_through_the_openai_sdk(cluster):
    sdk = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    resp = sdk.chat.completions.create(model="pdserve-tiny", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == entry.top_logprobs[0].logprob  # greedy picks the most likely


def test_stop_token_id_ends_the_output_at_that_token(http, hf_model):
    _, tokenizer = hf_model
    ids = greedy(http)["token_ids"]
    stop = ids[3]
    if stop in ids[:3]:
        stop = ids[4]
    choice = greedy(http, stop_token_ids=[stop])
    end = ids.index(stop)
    assert choice["token_ids"] == ids[: end + 1]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == tokenizer.decode(ids[:end])
    kept = greedy(http, stop_token_ids=[stop], include_stop_str_in_output=True)
    assert kept["text"] == tokenizer.decode(ids[: end + 1])


def test_min_tokens_masks_a_stop_token_until_reached(http):
    ids = greedy(http)["token_ids"]
    choice = greedy(http, stop_token_ids=[ids[0]], min_tokens=4)
    assert len(choice["token_ids"]) >= 4
    assert ids[0] not in choice["token_ids"][:4]


def test_penalties_change_the_greedy_output(http):
    plain = greedy(http, max_tokens=12)["token_ids"]
    penalised = greedy(http, max_tokens=12, repetition_penalty=2.0, presence_penalty=2.0)["token_ids"]
    assert penalised != plain


def test_echo_puts_the_prompt_before_the_completion(http):
    plain = greedy(http)["text"]
    assert greedy(http, echo=True)["text"] == PROMPT + plain
    body = {"model": "pdserve-tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "echo": True,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(p) for p in sse_events(r.read())[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT + plain


def test_echo_with_logprobs_scores_the_echoed_prompt(http, tokenizer):
    resp = http.post("/v1/completions", json={"model": "pdserve-tiny", "prompt": PROMPT, "echo": True,
                                              "logprobs": 1, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    block = resp.json()["choices"][0]["logprobs"]
    assert len(block["tokens"]) == len(tokenizer(PROMPT)["input_ids"]) + 2 and block["token_logprobs"][0] is None
