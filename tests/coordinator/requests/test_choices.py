"""Several generations as one response (coordinator/requests/choices.py): their events merged into one stream, tagged
with their choice, and written by the serving loop of one generation; without workers."""

from __future__ import annotations

import asyncio
import json

from aiohttp.test_utils import TestClient, TestServer

from coordinator.apis.openai_common import StreamOptions
from coordinator.apis.openai_completions import CompletionFormatter
from coordinator.requests.choices import merged, serve_choices
from coordinator.errors import WorkerError
from coordinator.requests.request import Failed, Finished, FinishReason, GenerationRequest, SamplingOptions, TokenDelta
from tests.helpers import one_route_app, sse_events


class ScriptedPipeline:
    """Each request id's generation: `num_tokens` tokens `step_s` apart, then its end (a failure with `fail`).
    `first_after` = {a: b}: a's first token waits until b's first token was handed on (30 s at most)."""

    def __init__(self, script: dict[str, tuple[int, float, bool]], first_after: dict[str, str] | None = None):
        self.script = script
        self.first_after = first_after or {}
        self.first_token_out: dict[str, asyncio.Event] = {rid: asyncio.Event() for rid in script}

    async def generate(self, request: GenerationRequest, listener=None):
        num_tokens, step_s, fail = self.script[request.request_id]
        for i in range(num_tokens):
            await asyncio.sleep(step_s)
            if i == 0 and request.request_id in self.first_after:
                other = self.first_token_out[self.first_after[request.request_id]]
                await asyncio.wait([asyncio.ensure_future(other.wait())], timeout=30)
            yield TokenDelta(10 + i, f"{request.request_id}{i}", i, 1.0, final=i == num_tokens - 1 and not fail)
            self.first_token_out[request.request_id].set()
        if fail:
            raise WorkerError(f"{request.request_id} lost", 503)
        yield Finished(FinishReason.LENGTH, prompt_tokens=2, completion_tokens=num_tokens)


def requests(*ids: str) -> list[GenerationRequest]:
    return [GenerationRequest(rid, [1, 2], SamplingOptions(seed=1)) for rid in ids]


async def test_merged_tags_each_event_with_its_choice_and_keeps_each_choices_order():
    # a's first token comes after b's: merged hands them on in that order if it reads both as they come.
    pipeline = ScriptedPipeline({"a": (3, 0.03, False), "b": (2, 0.002, False)}, first_after={"a": "b"})
    events = [e async for e in merged(pipeline, requests("a", "b"))]
    for choice, rid, num_tokens in ((0, "a", 3), (1, "b", 2)):
        own = [e for e in events if e.choice == choice]
        assert [e.text for e in own[:-1]] == [f"{rid}{i}" for i in range(num_tokens)]
        assert isinstance(own[-1], Finished) and own[-1].completion_tokens == num_tokens
    assert events[0].choice == 1, "events come as they are generated, not one choice after the other"


async def test_a_failed_choice_is_its_failed_event_and_the_others_go_on():
    pipeline = ScriptedPipeline({"a": (1, 0.001, True), "b": (3, 0.004, False)})
    events = [e async for e in merged(pipeline, requests("a", "b"))]
    failed = [e for e in events if isinstance(e, Failed)]
    assert [(f.choice, f.error.message) for f in failed] == [(0, "a lost")]
    assert isinstance(events[-1], Finished) and events[-1].choice == 1


async def test_a_choice_that_breaks_unexpectedly_is_a_500_failed_event_and_the_others_go_on():
    class BrokenFirstChoice(ScriptedPipeline):
        async def generate(self, request, listener=None):
            if request.request_id == "a":
                raise RuntimeError("a bug in the pipeline")
                yield  # an async generator, as the real pipeline's
            async for event in super().generate(request, listener):
                yield event

    events = [e async for e in merged(BrokenFirstChoice({"b": (2, 0.002, False)}), requests("a", "b"))]
    failed = [e for e in events if isinstance(e, Failed)]
    assert [(f.choice, f.error.status) for f in failed] == [(0, 500)]
    assert isinstance(events[-1], Finished) and events[-1].choice == 1


def stream(script: dict, stream_options: StreamOptions | None) -> list[dict]:
    async def handler(request):
        gens = requests(*script)
        formatters = [CompletionFormatter("cmpl-x", 1, "m", False, False, [1, 2], str, stream_options) for _ in gens]
        return await serve_choices(request, ScriptedPipeline(script), [gens], [formatters], len(gens), True)

    async def run():
        async with TestClient(TestServer(one_route_app(handler))) as client:
            return await (await client.post("/x")).read()

    payloads = sse_events(asyncio.run(run()))
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def test_a_stream_of_choices_ends_with_one_usage_chunk_for_the_request_after_every_choice_ended():
    chunks = stream({"a": (2, 0.002, False), "b": (4, 0.003, False)}, StreamOptions(include_usage=True))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 6,
                                                                   "total_tokens": 8}
    assert [c for c in chunks[:-1] if c["choices"] == []] == []
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1]


def test_a_choice_failing_mid_stream_ends_with_its_error_chunk_while_the_other_finishes():
    chunks = stream({"a": (1, 0.001, True), "b": (3, 0.004, False)}, None)
    by_choice = {i: [c for c in chunks if c["choices"][0]["index"] == i] for i in (0, 1)}
    assert [c["choices"][0]["text"] for c in by_choice[0][:-1]] == ["a0"]
    assert by_choice[0][-1]["error"]["message"] == "a lost"
    assert [c["choices"][0]["text"] for c in by_choice[1][:-1]] == ["b0", "b1", "b2"]
    assert by_choice[1][-1]["choices"][0]["finish_reason"] == "length" and "error" not in by_choice[1][-1]
