"""stream_options.include_usage / continuous_usage_stats, and max_completion_tokens."""

from __future__ import annotations

import pytest

import json

import openai

from tests.helpers import sse_events

pytestmark = pytest.mark.system

CHAT = {"model": "pdserve-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}


def chunks(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body) as r:
        return [json.loads(p) for p in sse_events(r.read())[:-1]]


def test_include_usage_adds_a_usage_only_chunk_at_the_end(http):
    out = chunks(http, "/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}})
    assert out[-1]["choices"] == [] and out[-1]["usage"]["completion_tokens"] == 4
    assert out[-2]["choices"][0]["finish_reason"] == "length"


def test_continuous_usage_stats_put_running_usage_on_every_chunk(http):
    for path, body in (("/v1/chat/completions", CHAT),
                       ("/v1/completions", {"model": "pdserve-tiny", "prompt": "Hi", "max_tokens": 4,
                                            "stream": True})):
        out = chunks(http, path, {**body, "stream_options": {"continuous_usage_stats": True}})
        assert [c["usage"]["completion_tokens"] for c in out[:-1]] == [1, 2, 3, 4]
        assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
                   for c in out)


def test_openai_sdk_include_usage_and_max_completion_tokens(cluster):
    sdk = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    stream = sdk.chat.completions.create(model="pdserve-tiny", messages=[{"role": "user", "content": "Hi"}],
                                         max_completion_tokens=3, stream=True,
                                         stream_options={"include_usage": True})
    got = list(stream)
    assert got[-1].usage.completion_tokens == 3 and got[-1].choices == []
