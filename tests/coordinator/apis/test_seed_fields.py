"""BladeLLM's request fields (docs/compatibility.md) on OpenAI chat and completions: logit_bias, stop_tokens,
resume_response and error_info (null on success, {code, message} on failure, in bodies and a stream's last event)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from coordinator.apis.fields import parse_request
from coordinator.apis.openai_chat import ChatCompletionRequest, ChatFormatter
from coordinator.apis.openai_common import error_body
from coordinator.apis.openai_completions import CompletionFormatter, CompletionRequest
from coordinator.apis.vllm_native import VllmGenerateRequest
from coordinator.requests.choices import serve_choices
from coordinator.errors import ApiError, WorkerError
from coordinator.requests.request import Finished, FinishReason, GenerationRequest, SamplingOptions, TokenDelta
from tests.helpers import one_route_app, sse_events

VOCAB = 1224
CHAT = {"model": "pdserve-tiny", "messages": [{"role": "user", "content": "Tell me a story"}]}
COMPLETION = {"model": "pdserve-tiny", "prompt": "Once upon a time"}
MODELS = [(ChatCompletionRequest, CHAT), (CompletionRequest, COMPLETION)]


def parse(model, base, **fields):
    return parse_request(model, {**base, **fields}, VOCAB)


def refused(model, base, **fields) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse(model, base, **fields)
    assert err.value.status == 400
    return err.value


# logit_bias

@pytest.mark.parametrize("model,base", MODELS + [(VllmGenerateRequest, {"prompt": "Hi"})])
def test_logit_bias_maps_to_sorted_token_bias_pairs(model, base):
    body = parse(model, base, logit_bias={"7": 100, "3": -100, "1223": 0.5})
    assert body.sampling().logit_bias == ((3, -100.0), (7, 100.0), (1223, 0.5))
    assert parse(model, base, logit_bias={}).sampling().logit_bias == ()
    assert parse(model, base).sampling().logit_bias == ()


@pytest.mark.parametrize("model,base", MODELS)
@pytest.mark.parametrize("bias,needle", [
    ({"5": 100.5}, "logit_bias: token 5: bias must be in [-100, 100], got 100.5"),
    ({"5": -101}, "bias must be in [-100, 100]"),
    ({"5": float("nan")}, "bias must be in [-100, 100]"),
    ({str(VOCAB): 1}, f"logit_bias: token id {VOCAB} is not in the vocabulary: ids must be in [0, {VOCAB})"),
    ({"-1": 1}, f"token id -1 is not in the vocabulary: ids must be in [0, {VOCAB})"),
    ({"five": 1}, "logit_bias: keys must be token ids written as integers, got 'five'"),
    ({"5": 1, "05": 2}, "token id 5 is given twice"),
    ({"5": "strong"}, "logit_bias.5"),
    ([5], "logit_bias"),
    ({str(i): 1 for i in range(301)}, "logit_bias: at most 300 token ids may be biased, got 301"),
])
def test_bad_logit_bias_is_400_naming_the_field_and_range(model, base, bias, needle):
    error = refused(model, base, logit_bias=bias)
    assert error.param.startswith("logit_bias") and needle in error.message


def test_logit_bias_without_a_served_model_is_checked_against_the_int32_range():
    body = parse_request(CompletionRequest, {**COMPLETION, "logit_bias": {"5000": 1}})
    assert body.sampling().logit_bias == ((5000, 1.0),)
    with pytest.raises(ApiError, match=r"must be in \[0, 2147483647\]"):
        parse_request(CompletionRequest, {**COMPLETION, "logit_bias": {"2147483648": 1}})


# stop_tokens

@pytest.mark.parametrize("model,base", MODELS)
def test_stop_tokens_is_stop_token_ids(model, base):
    assert parse(model, base, stop_tokens=[5, 9]).sampling().stop_token_ids == (5, 9)
    assert parse(model, base, stop_tokens=[5], stop_token_ids=[5]).sampling().stop_token_ids == (5,)
    assert parse(model, base, stop_token_ids=[4]).sampling().stop_token_ids == (4,)


@pytest.mark.parametrize("model,base", MODELS)
def test_stop_tokens_and_stop_token_ids_that_disagree_are_400_naming_both(model, base):
    error = refused(model, base, stop_tokens=[5], stop_token_ids=[6])
    assert "stop_token_ids=[6] and stop_tokens=[5] disagree" in error.message
    assert "stop_tokens: token ids must be in [0, 2147483647], got -1" in refused(model, base, stop_tokens=[-1]).message


# resume_response

def test_resume_response_must_be_a_non_empty_string():
    assert parse(ChatCompletionRequest, CHAT, resume_response="Once").resume_response == "Once"
    assert refused(ChatCompletionRequest, CHAT, resume_response="").param == "resume_response"
    assert refused(ChatCompletionRequest, CHAT, resume_response=5).param == "resume_response"


def test_resume_response_after_an_assistant_message_is_400():
    messages = CHAT["messages"] + [{"role": "assistant", "content": "Once upon"}]
    error = refused(ChatCompletionRequest, CHAT, messages=messages, resume_response="a time")
    assert "resume_response continues the reply to the last message, which must not be an assistant" in error.message


def test_resume_response_is_chat_only():
    assert refused(CompletionRequest, COMPLETION, resume_response="x").param == "resume_response"


# error_info

def test_openai_error_body_carries_error_info():
    assert error_body(ApiError(400, "max_tokens: bad", param="max_tokens")) == {
        "error": {"message": "max_tokens: bad", "type": "invalid_request_error", "param": "max_tokens", "code": 400},
        "error_info": {"code": 400, "message": "max_tokens: bad"}}


class FailingPipeline:
    """Yields `num_tokens` tokens, then fails as a lost worker does mid-stream."""

    def __init__(self, num_tokens: int, fail: bool = True):
        self.num_tokens = num_tokens
        self.fail = fail

    async def generate(self, request: GenerationRequest, listener=None):
        for i in range(self.num_tokens):
            yield TokenDelta(token_id=5, text="a", index=i, time_ms=1.0)
        if self.fail:
            raise WorkerError("decode worker lost", 503)
        yield Finished(FinishReason.LENGTH, prompt_tokens=2, completion_tokens=self.num_tokens)


def formatter(kind: str):
    args = ("cmpl-x", 1, "pdserve-tiny", False, False, [1, 2])
    return ChatFormatter(*args) if kind == "chat" else CompletionFormatter(*args)


def serve(kind: str, pipeline, stream: bool, num_choices: int = 1):
    async def handler(request: web.Request) -> web.StreamResponse:
        gens = [GenerationRequest(f"x-{i}", [1, 2], SamplingOptions(seed=1)) for i in range(num_choices)]
        return await serve_choices(request, pipeline, [gens], [[formatter(kind) for _ in gens]], num_choices, stream)

    async def run():
        async with TestClient(TestServer(one_route_app(handler))) as client:
            resp = await client.post("/x")
            return resp.status, await resp.read()

    return asyncio.run(run())


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("num_choices", [1, 2])
def test_a_late_stream_error_ends_with_error_info(kind, num_choices):
    status, raw = serve(kind, FailingPipeline(2), stream=True, num_choices=num_choices)
    assert status == 200
    payloads = sse_events(raw)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    for index in range(num_choices):
        own = [c for c in chunks if c["choices"][0]["index"] == index]
        assert len(own) == 3 and all("error_info" not in c for c in own[:-1])
        assert own[-1]["error_info"] == {"code": 503, "message": "decode worker lost"}
        assert own[-1]["error"]["code"] == 503 and own[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_failed_non_stream_response_is_the_error_body_with_error_info(kind):
    status, raw = serve(kind, FailingPipeline(2), stream=False)
    assert status == 503
    assert json.loads(raw)["error_info"] == {"code": 503, "message": "decode worker lost"}


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("num_choices", [1, 2])
def test_success_has_null_error_info_on_the_body_and_the_last_chunk(kind, num_choices):
    status, raw = serve(kind, FailingPipeline(3, fail=False), stream=False, num_choices=num_choices)
    body = json.loads(raw)
    assert status == 200 and body["error_info"] is None and len(body["choices"]) == num_choices
    status, raw = serve(kind, FailingPipeline(3, fail=False), stream=True, num_choices=num_choices)
    chunks = [json.loads(p) for p in sse_events(raw)[:-1]]
    assert [c["error_info"] for c in chunks if "error_info" in c] == [None] * num_choices
    assert all(c["choices"][0]["finish_reason"] for c in chunks if "error_info" in c)


# End to end, on the embedded model.

def completion(http, **fields) -> dict:
    resp = http.post("/v1/completions", json={**COMPLETION, "max_tokens": 6, "temperature": 0,
                                              "return_token_ids": True, **fields})
    assert resp.status_code == 200, resp.text
    return resp.json()


def chat(http, **fields) -> dict:
    resp = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 6, "temperature": 0,
                                                   "return_token_ids": True, **fields})
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.system
def test_logit_bias_plus_100_makes_greedy_output_that_token(http, hf_model):
    _, tokenizer = hf_model
    token = 42
    assert completion(http, logit_bias={str(token): 100})["choices"][0]["token_ids"] == [token] * 6
    assert chat(http, logit_bias={str(token): 100})["choices"][0]["token_ids"] == [token] * 6
    resp = http.post("/generate", json={"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0,
                                        "logit_bias": {str(token): 100}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["text"] == ["Once upon a time" + tokenizer.decode([token] * 6)]


@pytest.mark.system
def test_logit_bias_minus_100_bans_the_greedy_token(http):
    ids = completion(http)["choices"][0]["token_ids"]
    banned = completion(http, logit_bias={str(ids[0]): -100})["choices"][0]["token_ids"]
    assert ids[0] not in banned


@pytest.mark.system
def test_logit_bias_out_of_the_vocabulary_is_400_naming_the_id_and_range(http):
    for path, base in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        resp = http.post(path, json={**base, "logit_bias": {"99999": 5}})
        assert resp.status_code == 400
        body = resp.json()
        assert body["error"]["param"] == "logit_bias"
        assert f"token id 99999 is not in the vocabulary: ids must be in [0, {VOCAB})" in body["error"]["message"]
        assert body["error_info"]["code"] == 400
    resp = http.post("/generate", json={"prompt": "Hi", "logit_bias": {"5": 300}})
    assert resp.status_code == 400 and "logit_bias" in resp.json()["error"]


@pytest.mark.system
def test_stop_tokens_end_the_output_at_that_token(http):
    for send in (completion, chat):
        ids = send(http)["choices"][0]["token_ids"]
        stop = next(t for t in ids[1:] if t != ids[0])
        choice = send(http, stop_tokens=[stop])["choices"][0]
        assert choice["token_ids"] == ids[: ids.index(stop) + 1]
        assert choice["finish_reason"] == "stop"
    resp = http.post("/v1/completions", json={**COMPLETION, "stop_tokens": [1], "stop_token_ids": [2]})
    assert resp.status_code == 400 and "stop_token_ids=[2] and stop_tokens=[1] disagree" in resp.text


@pytest.mark.system
def test_resume_response_continues_the_assistant_turn(http, hf_model):
    _, tokenizer = hf_model
    partial = "Once upon a"
    generation_prompt = tokenizer.apply_chat_template(CHAT["messages"], add_generation_prompt=True, tokenize=False)
    expected_prompt = (tokenizer(generation_prompt, add_special_tokens=False)["input_ids"]
                       + tokenizer(partial, add_special_tokens=False)["input_ids"])
    resumed = chat(http, resume_response=partial)
    assert resumed["prompt_token_ids"] == expected_prompt
    assert resumed["usage"]["prompt_tokens"] == len(expected_prompt)
    # The output is what the model says after the partial reply, and holds only the continuation.
    continued = completion(http, prompt=expected_prompt)["choices"][0]
    assert resumed["choices"][0]["token_ids"] == continued["token_ids"]
    assert resumed["choices"][0]["message"]["content"] == continued["text"]
    assert resumed["error_info"] is None
    with http.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 6, "temperature": 0,
                                                           "resume_response": partial, "stream": True}) as r:
        chunks = [json.loads(p) for p in sse_events(r.read())[:-1]]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == continued["text"]
    assert chunks[-1]["error_info"] is None and chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.system
def test_resume_response_after_an_assistant_message_is_400_over_http(http):
    messages = CHAT["messages"] + [{"role": "assistant", "content": "Once"}]
    resp = http.post("/v1/chat/completions", json={**CHAT, "messages": messages, "resume_response": "upon"})
    assert resp.status_code == 400 and "must not be an assistant message" in resp.json()["error"]["message"]


@pytest.mark.system
def test_error_info_is_null_on_success_in_bodies_and_the_last_chunks(http):
    assert completion(http)["error_info"] is None
    assert chat(http)["error_info"] is None
    for path, base in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        body = {**base, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", path, json=body) as r:
            chunks = [json.loads(p) for p in sse_events(r.read())[:-1]]
        assert [("error_info" in c) for c in chunks] == [False, False, False, True, True]
        assert chunks[-2]["error_info"] is None and chunks[-1]["error_info"] is None


@pytest.mark.system
def test_a_refused_request_has_error_info_beside_the_openai_error(http):
    resp = http.post("/v1/chat/completions", json={**CHAT, "temperature": -1})
    assert resp.status_code == 400
    body = resp.json()
    assert body["error_info"] == {"code": 400, "message": body["error"]["message"]}
