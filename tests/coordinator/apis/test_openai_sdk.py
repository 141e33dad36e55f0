"""The official `openai` client against the coordinator, with no code of ours in between."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def sdk(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)


def test_sdk_chat_completion(sdk):
    resp = sdk.chat.completions.create(model="pdserve-tiny", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 4


def test_sdk_chat_stream_matches_non_stream(sdk):
    kwargs = dict(model="pdserve-tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0)
    whole = sdk.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(sdk.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 6


def test_sdk_completion_and_stream(sdk):
    whole = sdk.completions.create(model="pdserve-tiny", prompt="Hello", max_tokens=5, temperature=0)
    streamed = list(sdk.completions.create(model="pdserve-tiny", prompt="Hello", max_tokens=5, temperature=0,
                                           stream=True))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert whole.usage.completion_tokens == 5


def test_sdk_surfaces_validation_errors(sdk):
    with pytest.raises(openai.BadRequestError) as err:
        sdk.completions.create(model="pdserve-tiny", prompt="Hello", temperature=-1)
    assert "temperature" in str(err.value)
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="nope", prompt="Hello")
