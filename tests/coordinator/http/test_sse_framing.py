"""SSE framing and chunk fields as in the chat streaming page (docs/compatibility.md), for chat and completions."""

from __future__ import annotations

import pytest

import json

from tests.helpers import sse_events

pytestmark = pytest.mark.system


def stream(http, path: str, body: dict) -> list[str]:
    with http.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        return sse_events(resp.read())


def test_chat_stream_events_are_data_frames_ending_with_done(http):
    payloads = stream(http, "/v1/chat/completions", {
        "model": "pdserve-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True,
    })
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert len(chunks) == 6  # five token chunks, then the final chunk
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        assert isinstance(chunk["created"], int)
        assert chunk["model"] == "pdserve-tiny"
        (choice,) = chunk["choices"]
        assert choice["index"] == 0
        assert choice["delta"]["role"] == "assistant"
        assert isinstance(choice["delta"]["content"], str)
    for chunk in chunks[:-1]:
        assert chunk["choices"][0]["finish_reason"] is None
        assert "usage" not in chunk
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["choices"][0]["delta"]["content"] == ""
    assert final["usage"] == {"prompt_tokens": final["usage"]["prompt_tokens"], "completion_tokens": 5,
                              "total_tokens": final["usage"]["prompt_tokens"] + 5}


def test_chat_stream_text_equals_non_stream_text(http):
    body = {"model": "pdserve-tiny", "messages": [{"role": "user", "content": "Tell me a short story"}],
            "max_tokens": 9, "temperature": 0}
    whole = http.post("/v1/chat/completions", json=body).json()
    payloads = stream(http, "/v1/chat/completions", {**body, "stream": True})
    streamed = "".join(json.loads(p)["choices"][0]["delta"]["content"] for p in payloads[:-1])
    assert streamed == whole["choices"][0]["message"]["content"]
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["role"] == "assistant"


def test_completion_stream_chunks_are_text_completion_objects(http):
    payloads = stream(http, "/v1/completions", {"model": "pdserve-tiny", "prompt": "Hello", "max_tokens": 4,
                                                "stream": True, "temperature": 0})
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    whole = http.post("/v1/completions", json={"model": "pdserve-tiny", "prompt": "Hello", "max_tokens": 4,
                                               "temperature": 0}).json()
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
