"""Tools through the running cluster: rendered by the chat template, validated, multi-turn accepted."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.system

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CHAT = {"model": "pdserve-tiny", "messages": [{"role": "user", "content": "Weather in Berlin?"}], "max_tokens": 3}


def test_tools_are_rendered_into_the_prompt(http):
    plain = http.post("/v1/chat/completions", json=CHAT).json()["usage"]["prompt_tokens"]
    resp = http.post("/v1/chat/completions", json={**CHAT, "tools": TOOLS, "tool_choice": "auto"})
    assert resp.status_code == 200
    assert resp.json()["usage"]["prompt_tokens"] > plain + 20


def test_multi_turn_with_a_tool_result_is_accepted(http):
    messages = [
        {"role": "user", "content": "Weather in Berlin?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": "{\"city\": \"Berlin\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C, cloudy"},
    ]
    resp = http.post("/v1/chat/completions", json={**CHAT, "messages": messages, "tools": TOOLS})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("body,needle", [
    ({**CHAT, "tool_choice": "auto"}, "tool_choice needs tools"),
    ({**CHAT, "tools": TOOLS, "tool_choice": "always"}, "expected \"none\", \"auto\", \"required\""),
    ({**CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "not one of the tools (get_weather)"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
])
def test_bad_tool_requests_are_400(http, body, needle):
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400 and needle in resp.json()["error"]["message"]


def test_openai_sdk_sends_tools(cluster):
    sdk = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    resp = sdk.chat.completions.create(model="pdserve-tiny", messages=[{"role": "user", "content": "Hi"}],
                                       tools=TOOLS, max_tokens=3, temperature=0)
    assert resp.choices[0].finish_reason in ("length", "stop", "tool_calls")


@pytest.mark.parametrize("tool_calls,needle", [
    ([{}], "messages.1.tool_calls.0.function"),
    ([{"type": "function", "function": {"arguments": "{}"}}], "messages.1.tool_calls.0.function.name"),
    ([{"type": "code", "function": {"name": "f"}}], "messages.1.tool_calls.0.type"),
])
def test_a_past_tool_call_that_is_not_a_function_call_is_400_not_500(http, tool_calls, needle):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x", "tool_calls": tool_calls}]
    resp = http.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    assert resp.status_code == 400 and needle in resp.json()["error"]["message"]


def test_past_tool_call_arguments_given_as_an_object_are_rendered_as_json(http):
    as_text = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]
    as_object = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]
    counts = []
    for calls in (as_text, as_object):
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": calls},
                    {"role": "tool", "tool_call_id": "c1", "content": "5 C"}]
        resp = http.post("/v1/chat/completions", json={**CHAT, "messages": messages, "tools": TOOLS,
                                                        "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        counts.append(resp.json()["prompt_token_ids"])
    assert counts[0] == counts[1]
