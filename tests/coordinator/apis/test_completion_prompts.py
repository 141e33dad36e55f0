"""Completions `prompt` in every OpenAI form: a string, a batch of strings, token ids, a batch of token id
lists (and the MindIE API's typed items, docs/compatibility.md); one choice group per prompt, indexed prompt-major
with n."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from coordinator.apis.fields import parse_request
from coordinator.apis.openai_completions import MAX_BATCH_GENERATIONS, CompletionFormatter, CompletionRequest
from coordinator.apis.prompts import prompt_batch
from coordinator.requests.choices import serve_choices
from coordinator.errors import ApiError
from coordinator.requests.request import GenerationRequest, SamplingOptions
from tests.helpers import one_route_app, sse_events

BASE = {"model": "pdserve-tiny", "max_tokens": 5, "temperature": 0}
SAMPLED = {"model": "pdserve-tiny", "max_tokens": 5, "temperature": 1.3, "seed": 7}
VOCAB = 1224


def parse(prompt, **fields) -> CompletionRequest:
    return parse_request(CompletionRequest, {"model": "m", "prompt": prompt, **fields}, VOCAB)


@pytest.mark.parametrize("prompt,batch", [
    ("Once upon", ["Once upon"]),
    (["Once upon"], ["Once upon"]),
    (["a", "b"], ["a", "b"]),
    ([5, 6, 7], [[5, 6, 7]]),
    ([[5, 6], [7]], [[5, 6], [7]]),
    ([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], [[{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}]]),
])
def test_every_openai_prompt_form_is_a_batch_of_prompts(prompt, batch):
    assert prompt_batch(parse(prompt).prompt) == batch


@pytest.mark.parametrize("prompt,needle", [
    ([], "must be a string, or a non-empty list"),
    (5, "must be a string, or a non-empty list"),
    (None, "must be a string, or a non-empty list"),
    (["a", 5], "not a mix of strings and token ids"),
    ([[1], "a"], "not a mix of lists of token ids and strings"),
    (["a", {"type": "text", "text": "b"}], "not a mix of strings and typed items"),
    ([True], "got bool"),
    ([1.5], "got float"),
    ([[]], "item 0 must be a non-empty list of token ids"),
    ([[1], [2, "x"]], "item 1 must be a non-empty list of token ids"),
    ([VOCAB], f"token id {VOCAB} is not in the vocabulary: ids must be in [0, {VOCAB})"),
    ([-1], f"token id -1 is not in the vocabulary: ids must be in [0, {VOCAB})"),
    ([[1], [2, VOCAB + 5]], f"token id {VOCAB + 5} is not in the vocabulary"),
])
def test_malformed_prompt_is_400_naming_prompt(prompt, needle):
    with pytest.raises(ApiError) as err:
        parse(prompt)
    assert err.value.status == 400 and err.value.param == "prompt"
    assert err.value.message.startswith("prompt: ") and needle in err.value.message


def test_a_batch_is_bounded_in_generations():
    parse(["a"] * 16, n=128)
    with pytest.raises(ApiError) as err:
        parse(["a"] * 17, n=128)
    assert f"17 prompts x 128 generations each is more than {MAX_BATCH_GENERATIONS}" in err.value.message


def test_a_failed_prompt_of_a_batch_cancels_the_other_generations():
    cancelled = []

    class Pipeline:
        async def generate(self, request: GenerationRequest, listener=None):
            if request.request_id == "bad":
                raise ApiError(400, "max_tokens: too many for this prompt", param="max_tokens")
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(request.request_id)
                raise
            yield

    async def handler(request: web.Request) -> web.StreamResponse:
        groups = [[GenerationRequest(rid, [1], SamplingOptions(seed=1))] for rid in ("slow", "bad")]
        formatters = [[CompletionFormatter("cmpl-x", 1, "m", False, False, [1])] for _ in groups]
        return await serve_choices(request, Pipeline(), groups, formatters, 1, stream=False)

    async def run():
        async with TestClient(TestServer(one_route_app(handler))) as client:
            resp = await client.post("/x")
            return resp.status, await resp.json(), list(cancelled)  # before the app's shutdown cancels anything

    status, body, cancelled_by_then = asyncio.run(run())
    assert status == 400 and body["error"]["param"] == "max_tokens"
    assert cancelled_by_then == ["slow"]


def post(http, **fields) -> dict:
    resp = http.post("/v1/completions", json={**BASE, **fields})
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.system
def test_a_list_of_one_string_is_the_string(http):
    single = post(http, prompt="Once upon")
    listed = post(http, prompt=["Once upon"])
    assert listed["choices"] == single["choices"] and listed["usage"] == single["usage"]


@pytest.mark.system
def test_a_batch_gives_each_prompt_its_n_choices_indexed_prompt_major(http):
    prompts = ["Hello there", "1 2 3 4 5", "Hello there"]
    batch = post(http, **SAMPLED, prompt=prompts, n=2)
    singles = [post(http, **SAMPLED, prompt=p, n=2) for p in prompts]
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    expected = [c["text"] for s in singles for c in s["choices"]]
    assert [c["text"] for c in batch["choices"]] == expected
    prompt_tokens = sum(s["usage"]["prompt_tokens"] for s in singles)
    completion_tokens = sum(s["usage"]["completion_tokens"] for s in singles)
    assert batch["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                              "total_tokens": prompt_tokens + completion_tokens}
    assert batch["error_info"] is None and batch["id"].startswith("cmpl-")


@pytest.mark.system
def test_token_id_prompts_are_served_as_their_text(http, hf_model):
    _, tokenizer = hf_model
    texts = ["Hello there", "The coordinator sends the prompt"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    by_text = post(http, prompt=texts, return_token_ids=True)
    one = post(http, prompt=ids[0], return_token_ids=True)
    assert one["choices"][0]["prompt_token_ids"] == ids[0]
    assert one["choices"][0]["token_ids"] == by_text["choices"][0]["token_ids"]
    by_ids = post(http, prompt=ids, return_token_ids=True)
    assert by_ids["choices"] == by_text["choices"] and by_ids["usage"] == by_text["usage"]
    assert [c["prompt_token_ids"] for c in by_ids["choices"]] == ids


@pytest.mark.system
def test_best_of_ranks_within_each_prompts_group(http):
    prompts = ["Once upon a time", "1 2 3 4 5"]
    batch = post(http, **SAMPLED, prompt=prompts, n=2, best_of=4)
    singles = [post(http, **SAMPLED, prompt=p, n=2, best_of=4) for p in prompts]
    assert [c["text"] for c in batch["choices"]] == [c["text"] for s in singles for c in s["choices"]]
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]


@pytest.mark.system
def test_echo_repeats_each_choices_own_prompt(http, hf_model):
    _, tokenizer = hf_model
    prompts = ["Hello there", "1 2 3"]
    plain = post(http, prompt=prompts)
    echoed = post(http, prompt=prompts, echo=True)
    assert [c["text"] for c in echoed["choices"]] == [p + c["text"] for p, c in zip(prompts, plain["choices"])]
    ids = tokenizer("Hello there")["input_ids"]
    by_ids = post(http, prompt=[ids], echo=True)
    assert by_ids["choices"][0]["text"] == tokenizer.decode(ids) + plain["choices"][0]["text"]


@pytest.mark.system
def test_a_streamed_batch_tags_chunks_by_choice_and_sums_usage_once(http):
    prompts = ["Hello there", "1 2 3 4 5"]
    body = {**SAMPLED, "prompt": prompts, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as r:
        payloads = sse_events(r.read())
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    texts = {i: "" for i in range(4)}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["text"]
    finals = [c for c in chunks[:-1] if c["choices"][0]["finish_reason"]]
    assert sorted(c["choices"][0]["index"] for c in finals) == [0, 1, 2, 3]
    assert all(c["error_info"] is None for c in finals)
    whole = post(http, **SAMPLED, prompt=prompts, n=2)
    assert [texts[i] for i in range(4)] == [c["text"] for c in whole["choices"]]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    assert usage_chunk["error_info"] is None
    assert [c for c in chunks if c["choices"] == []] == [usage_chunk]  # one usage chunk for the request


@pytest.mark.system
def test_typed_items_keep_the_multimodal_rules(http):
    items = [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]
    assert post(http, prompt=items)["choices"] == post(http, prompt="Hello there")["choices"]
    resp = http.post("/v1/completions", json={**BASE, "prompt": [{"type": "text", "text": "hi"}, {
        "type": "image_url", "image_url": "data:image/jpeg;base64,AAAA"}]})
    assert resp.status_code == 400 and "text-only" in resp.json()["error"]["message"]


@pytest.mark.system
@pytest.mark.parametrize("prompt,param,needle", [
    ([[1, 2], [VOCAB]], "prompt", f"[0, {VOCAB})"),
    (["a", 1], "prompt", "not a mix"),
    (["Hello", ""], "prompt.1", "prompt.1 must not be empty"),
    (["Hello", "hello world " * 600], "prompt.1", "the limit is min(maxInputTokenLen"),
    ([list(range(5, 600))], "prompt", "the limit is min(maxInputTokenLen"),
])
def test_bad_prompts_are_400_in_openai_format(http, prompt, param, needle):
    resp = http.post("/v1/completions", json={**BASE, "prompt": prompt})
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert body["error"]["param"] == param and needle in body["error"]["message"]
    assert body["error_info"] == {"code": 400, "message": body["error"]["message"]}


@pytest.mark.system
def test_openai_sdk_sends_every_prompt_form(cluster, hf_model):
    _, tokenizer = hf_model
    sdk = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    texts = ["Once upon", "Hello there"]
    by_text = sdk.completions.create(model="pdserve-tiny", prompt=texts, max_tokens=4, temperature=0)
    assert [c.index for c in by_text.choices] == [0, 1]
    one = sdk.completions.create(model="pdserve-tiny", prompt="Hello there", max_tokens=4, temperature=0)
    assert by_text.choices[1].text == one.choices[0].text
    ids = [tokenizer(t)["input_ids"] for t in texts]
    by_ids = sdk.completions.create(model="pdserve-tiny", prompt=ids, max_tokens=4, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    single_ids = sdk.completions.create(model="pdserve-tiny", prompt=ids[1], max_tokens=4, temperature=0)
    assert single_ids.choices[0].text == one.choices[0].text
    assert by_text.usage.prompt_tokens == sum(len(i) for i in ids)


@pytest.mark.system
def test_langchain_openai_completions_llm_with_a_list_prompt(cluster):
    from langchain_openai import OpenAI

    llm = OpenAI(base_url=cluster.url + "/v1", api_key="unused", model="pdserve-tiny", max_tokens=4,
                 temperature=0, max_retries=0)
    text = llm.invoke("Once upon")
    assert isinstance(text, str)
    result = llm.generate(["Once upon", "Hello there", "Once upon"])
    outputs = [g[0].text for g in result.generations]
    assert len(outputs) == 3 and outputs[0] == outputs[2] == text
    assert result.llm_output["token_usage"]["completion_tokens"] == 12
    streamed = "".join(llm.stream("Once upon"))
    assert streamed == text
