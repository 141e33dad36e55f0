"""Reasoning and tool calls split out of streamed assistant text, and how chat responses carry them."""

from __future__ import annotations

import json

import pytest

from coordinator.apis.chat_output import ChatOutputParser, split_whole
from coordinator.apis.openai_chat import ChatFormatter
from coordinator.requests.request import Finished, FinishReason, TokenDelta
from coordinator.requests.serving import Transcript

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Berlin"}}</tool_call>'


def feed_all(parser: ChatOutputParser, pieces: list[str]):
    outs = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(o.content for o in outs), "".join(o.reasoning for o in outs)


def test_think_block_becomes_reasoning_even_with_tags_split_across_deltas():
    content, reasoning = feed_all(ChatOutputParser(), ["<th", "ink>Let me ", "think.</th", "ink>The answer", " is 4."])
    assert reasoning == "Let me think." and content == "The answer is 4."


def test_partial_tag_is_never_released_as_content():
    parser = ChatOutputParser()
    assert parser.feed("Hello <thi").content == "Hello "
    assert parser.feed("s is not a tag").content == "<this is not a tag"


def test_tool_call_blocks_are_parsed_into_openai_calls():
    content, reasoning, calls = split_whole("Sure. " + CALL, parse_tools=True)
    assert content == "Sure. " and reasoning == ""
    (call,) = calls
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Berlin"}
    assert call["id"].startswith("call_")


def test_tool_tags_are_plain_text_when_tools_are_off():
    content, _, calls = split_whole(CALL, parse_tools=False)
    assert content == CALL and calls == []


@pytest.mark.parametrize("text", ['<tool_call>{"name": "f", "argu', "<tool_call>not json</tool_call>"])
def test_unterminated_or_invalid_tool_call_stays_content(text):
    content, _, calls = split_whole(text, parse_tools=True)
    assert calls == [] and content == text


def deltas_for(text: str, size: int = 3) -> list[TokenDelta]:
    parts = [text[i:i + size] for i in range(0, len(text), size)]
    return [TokenDelta(token_id=i, text=p, index=i, time_ms=1.0, final=i == len(parts) - 1)
            for i, p in enumerate(parts)]


def run_stream(text: str, parse_tools: bool) -> list[dict]:
    formatter = ChatFormatter("chatcmpl-x", 0, "m", False, False, [1, 2])
    formatter.parse_tools = parse_tools
    transcript, frames = Transcript(), []
    for d in deltas_for(text):
        transcript.text += d.text
        transcript.deltas.append(d)
        frames += formatter.token_frames(d, transcript)
    finished = Finished(FinishReason.EOS, prompt_tokens=2, completion_tokens=len(transcript.deltas))
    transcript.finished = finished
    return frames + formatter.final_frames(finished, transcript)


def test_streamed_reasoning_goes_to_delta_reasoning_fields():
    frames = run_stream("<think>plan it</think>Done.", parse_tools=False)
    reasoning = "".join(f["choices"][0]["delta"].get("reasoning_content", "") for f in frames)
    content = "".join(f["choices"][0]["delta"]["content"] for f in frames)
    assert reasoning == "plan it" and content == "Done."
    assert all(f["choices"][0]["delta"].get("reasoning") == f["choices"][0]["delta"].get("reasoning_content")
               for f in frames)


def test_streamed_tool_call_arrives_in_the_final_chunk_with_finish_reason_tool_calls():
    frames = run_stream("Checking. " + CALL, parse_tools=True)
    content = "".join(f["choices"][0]["delta"]["content"] for f in frames)
    assert content == "Checking. " and "<tool_call>" not in content
    final = frames[-1]["choices"][0]
    assert final["finish_reason"] == "tool_calls"
    assert final["delta"]["tool_calls"][0]["index"] == 0
    assert final["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_non_stream_message_carries_tool_calls_and_reasoning():
    formatter = ChatFormatter("chatcmpl-x", 0, "m", False, False, [1])
    formatter.parse_tools = True
    transcript = Transcript(text="<think>hmm</think>" + CALL)
    transcript.finished = Finished(FinishReason.EOS, 1, 5)
    choice = formatter.response(transcript)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None and choice["message"]["reasoning_content"] == "hmm"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
