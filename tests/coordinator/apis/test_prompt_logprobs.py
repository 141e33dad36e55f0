"""Prompt logprobs through PD: computed on the prefill worker over every position, relayed with the first token,
shown the way each API asks (completions echo + logprobs, vLLM's prompt_logprobs, TGI decoder_input_details),
and equal to the model's own log-softmax; chat echo returns the rendered prompt with the reply."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import sse_events

pytestmark = pytest.mark.system

PROMPT = "The prefill worker computes the cache of every prompt and sends it on"


@pytest.fixture(scope="module")
def reference(hf_model):
    """`reference(ids)`: each prompt token's logprob after the first, and the log-softmax rows, as transformers
    computes them."""
    model, _ = hf_model

    def compute(ids: list[int]) -> tuple[list[float], torch.Tensor]:
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0].float()
        rows = torch.log_softmax(logits, dim=-1)
        return [rows[i, ids[i + 1]].item() for i in range(len(ids) - 1)], rows

    return compute


def test_completion_echo_with_logprobs_scores_the_prompt_as_the_model_does(http, tokenizer, reference):
    resp = http.post("/v1/completions", json={"model": "pdserve-tiny", "prompt": PROMPT, "max_tokens": 3,
                                              "temperature": 0, "echo": True, "logprobs": 2})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    ids = tokenizer(PROMPT)["input_ids"]
    block = choice["logprobs"]
    assert choice["text"].startswith(PROMPT)
    assert len(block["tokens"]) == len(ids) + 3
    assert block["token_logprobs"][0] is None and block["top_logprobs"][0] is None
    expected, _ = reference(ids)
    assert block["token_logprobs"][1 : len(ids)] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) <= 2 for top in block["top_logprobs"][1:])


def test_vllm_prompt_logprobs_give_each_tokens_rank_and_the_top_alternatives(http, tokenizer, reference):
    resp = http.post("/v1/completions", json={"model": "pdserve-tiny", "prompt": PROMPT, "max_tokens": 2,
                                              "temperature": 0, "prompt_logprobs": 3})
    assert resp.status_code == 200, resp.text
    scored = resp.json()["choices"][0]["prompt_logprobs"]
    ids = tokenizer(PROMPT)["input_ids"]
    expected, rows = reference(ids)
    assert scored[0] is None and len(scored) == len(ids)
    for i, (token, position) in enumerate(zip(ids[1:], scored[1:])):
        entry = position[str(token)]
        assert entry["logprob"] == pytest.approx(expected[i], abs=1e-4)
        assert entry["rank"] == int((rows[i] > rows[i, token]).sum()) + 1
        top = rows[i].topk(3).indices.tolist()
        assert set(map(str, top)) <= set(position) and position[str(top[0])]["rank"] == 1


def test_prompt_logprobs_of_a_prompt_the_prefix_cache_holds_are_still_every_position(http, tokenizer):
    body = {"model": "pdserve-tiny", "prompt": PROMPT * 3, "max_tokens": 2, "temperature": 0}
    assert http.post("/v1/completions", json=body).status_code == 200  # now cached
    scored = http.post("/v1/completions", json={**body, "prompt_logprobs": 0}).json()["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(tokenizer(PROMPT * 3)["input_ids"]) and all(p is not None for p in scored[1:])


def test_streamed_echo_with_logprobs_scores_the_prompt_in_the_first_chunk(http, tokenizer):
    with http.stream("POST", "/v1/completions", json={"model": "pdserve-tiny", "prompt": PROMPT, "max_tokens": 3,
                                                      "temperature": 0, "echo": True, "logprobs": 0,
                                                      "stream": True}) as resp:
        assert resp.status_code == 200
        chunks = [json.loads(p) for p in sse_events(resp.read())[:-1]]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(PROMPT)
    assert len(first["logprobs"]["tokens"]) == len(tokenizer(PROMPT)["input_ids"]) + 1


def test_tgi_decoder_input_details_lists_the_prompt_with_logprobs(http, tokenizer, reference):
    resp = http.post("/generate", json={"inputs": PROMPT, "parameters": {"decoder_input_details": True,
                                                                          "max_new_tokens": 2}})
    assert resp.status_code == 200, resp.text
    prefill = resp.json()["details"]["prefill"]
    ids = tokenizer(PROMPT)["input_ids"]
    assert [t["id"] for t in prefill] == ids and prefill[0]["logprob"] is None
    expected, _ = reference(ids)
    assert [t["logprob"] for t in prefill[1:]] == pytest.approx(expected, abs=1e-4)


def test_chat_echo_returns_the_rendered_prompt_with_the_reply(http, tokenizer):
    messages = [{"role": "user", "content": "Say something."}]
    body = {"model": "pdserve-tiny", "messages": messages, "max_tokens": 4, "temperature": 0}
    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    echoed = http.post("/v1/chat/completions", json={**body, "echo": True}).json()["choices"][0]["message"]["content"]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert echoed == rendered + plain


def test_prompt_logprobs_out_of_range_are_400_naming_the_field(http):
    resp = http.post("/v1/completions", json={"model": "pdserve-tiny", "prompt": "x", "prompt_logprobs": 21})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt_logprobs"
