"""Bad input gets a 4xx in OpenAI's error format naming the field, and the server keeps serving."""

from __future__ import annotations

import json

import pytest

from tests.helpers import CLUSTER_MAX_SEQ_LEN

pytestmark = pytest.mark.system

CHAT = {"model": "pdserve-tiny", "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": "pdserve-tiny", "prompt": "Hi"}

OUT_OF_RANGE = [
    ("temperature", -0.5, ">= 0.0"),
    ("top_p", 0, "(1e-6, 1.0]"),
    ("top_p", 1.5, "(1e-6, 1.0]"),
    ("top_k", 0, "-1 or in (0, 2147483647]"),
    ("top_k", -2, "-1 or in (0, 2147483647]"),
    ("seed", 0, "(0, 18446744073709551615]"),
    ("seed", 18446744073709551616, "(0, 18446744073709551615]"),
    ("max_tokens", 0, "(0, 2147483647]"),
    ("max_tokens", 2147483648, "(0, 2147483647]"),
    ("stop", "", "1 to 32768 characters"),
    ("stop", ["ok", ""], "at least 1 character"),
    ("stop", ["x" * 20000, "y" * 20000], "at most 32768 characters in total"),
    ("repetition_penalty", 0, "(0.0, 2.0]"),
    ("repetition_penalty", 2.5, "(0.0, 2.0]"),
    ("presence_penalty", -2.5, "[-2.0, 2.0]"),
    ("frequency_penalty", 2.01, "[-2.0, 2.0]"),
    ("stop_token_ids", [-1], "token ids must be in [0, 2147483647]"),
    ("min_tokens", -1, "[0, 2147483647]"),
]


@pytest.mark.parametrize("path,base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
@pytest.mark.parametrize("field,value,range_text", OUT_OF_RANGE)
def test_out_of_range_value_is_400_naming_field_and_range(http, path, base, field, value, range_text):
    resp = http.post(path, json={**base, field: value})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["message"].startswith(f"{field}:")
    assert range_text in error["message"]
    assert error["param"] == field and error["code"] == 400 and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("field,value", [("suffix", "x")])
def test_not_yet_supported_field_is_400_not_ignored(http, field, value):
    resp = http.post("/v1/chat/completions", json={**CHAT, field: value})
    assert resp.status_code == 400
    assert f"{field} is not supported" in resp.json()["error"]["message"]


def test_not_yet_supported_field_at_its_default_is_accepted(http):
    resp = http.post("/v1/chat/completions", json={**CHAT, "n": 1, "best_of": 1, "max_tokens": 2})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("body,needle", [
    ({**CHAT, "bogus": 1}, "bogus: unknown field"),
    ({**CHAT, "temperature": "hot"}, "temperature:"),
    ({**CHAT, "messages": []}, "messages:"),
    ({**CHAT, "messages": [{"role": "user", "content": ""}]}, "non-empty content"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": CHAT["messages"]}, "model:"),
])
def test_malformed_chat_body_is_400_naming_the_problem(http, body, needle):
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400
    assert needle in resp.json()["error"]["message"]


def test_invalid_json_is_400(http):
    resp = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert "not valid JSON" in resp.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/generate", "/v2/models/pdserve-tiny/generate"])
def test_deeply_nested_json_is_400_in_the_apis_format_and_the_server_keeps_serving(http, path):
    depth = 100_000
    body = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    resp = http.post(path, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    error = resp.json()["error"]
    message = error["message"] if path.startswith("/v1/") else error  # OpenAI's body, else the TGI family's
    assert message == "request body is not valid JSON: nested too deeply"
    assert http.post("/v1/completions", json={**COMPLETION, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32", "utf-8-sig"])
def test_a_body_in_another_unicode_encoding_is_read_as_json(http, encoding):
    body = json.dumps({**COMPLETION, "max_tokens": 2}).encode(encoding)
    resp = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 2


def test_non_object_body_is_400(http):
    assert http.post("/v1/completions", json=[1, 2]).status_code == 400


def test_unknown_model_is_404_in_openai_format(http):
    resp = http.post("/v1/completions", json={**COMPLETION, "model": "gpt-9"})
    assert resp.status_code == 404
    assert resp.json()["error"]["param"] == "model"


def test_prompt_over_the_token_limit_is_400_naming_the_limits(http):
    resp = http.post("/v1/completions", json={**COMPLETION, "prompt": "hello world " * CLUSTER_MAX_SEQ_LEN})
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert f"maxSeqLen-1={CLUSTER_MAX_SEQ_LEN - 1}" in message and "maxInputTokenLen" in message


def test_prompt_over_4mb_is_413(http):
    resp = http.post("/v1/completions", json={**COMPLETION, "prompt": "a" * (4 * 1024 * 1024 + 1)})
    assert resp.status_code == 413


def test_unknown_path_and_wrong_method_answer_in_openai_format(http):
    assert http.get("/v1/nothing").json()["error"]["code"] == 404
    resp = http.get("/v1/completions")
    assert resp.status_code == 405 and resp.json()["error"]["code"] == 405


def test_server_keeps_serving_after_bad_requests(http):
    resp = http.post("/v1/completions", json={**COMPLETION, "max_tokens": 2})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/completions", {**COMPLETION, "logprobs": 6}, "logprobs: must be in [0, 5]"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs requires logprobs=true"),
    ("/v1/completions", {**COMPLETION, "min_tokens": 5, "max_tokens": 2}, "min_tokens=5 exceeds max_tokens=2"),
])
def test_inconsistent_or_out_of_range_logprobs_and_min_tokens_are_400(http, path, body, needle):
    resp = http.post(path, json=body)
    assert resp.status_code == 400
    assert needle in resp.json()["error"]["message"]


def test_stream_options_without_stream_is_400(http):
    resp = http.post("/v1/chat/completions", json={**CHAT, "stream_options": {"include_usage": True}})
    assert resp.status_code == 400 and "only allowed when stream is true" in resp.json()["error"]["message"]


def test_disagreeing_max_tokens_and_max_completion_tokens_is_400(http):
    resp = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3, "max_completion_tokens": 4})
    assert resp.status_code == 400 and "disagree" in resp.json()["error"]["message"]
