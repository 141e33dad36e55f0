"""`n` / `best_of`, and batches of prompts: several generations answered as one response.

A request is one group of generations per prompt (one prompt unless a completion sends a batch).
Each generation of a group has its own seed (the request's seed + i), so choices differ when
sampling and stay reproducible. With best_of > n, each group's n with the highest cumulative
logprob are returned. Choice `j` of prompt `g` is choice index g * n + j, as OpenAI numbers them.
Streams merge the generations' events into one stream, each event tagged with its choice, written by
serving.py's one loop as n = 1's are: the choices' chunks interleave, each tagged with its choice index,
and end with one usage-only chunk for the whole request when the client asked for usage.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from coordinator.errors import ApiError
from coordinator.requests.pipeline import RequestPipeline
from coordinator.requests.request import Failed, Finished, GenerationEvent, GenerationRequest, TokenDelta
from coordinator.requests.serving import (TokenWriter, Transcript, admitted, collect, json_dumps, serve_generation,
                                          stream_events)
from coordinator.tenancy.admission import close_tickets

log = logging.getLogger(__name__)

_SEED_MASK = (1 << 63) - 1


def fan_out(request: GenerationRequest, count: int) -> list[GenerationRequest]:
    """`count` copies of a request, each with its own id and seed."""
    if count == 1:
        return [request]
    base = request.sampling.seed or 1
    return [dataclasses.replace(request, request_id=f"{request.request_id}-{i}",
                                sampling=dataclasses.replace(request.sampling, seed=(base + i) & _SEED_MASK or 1))
            for i in range(count)]


def _with_index(frame, index: int):
    if isinstance(frame, dict):
        for choice in frame.get("choices", []):
            choice["index"] = index
    return frame


def _score(transcript: Transcript) -> float:
    return sum(d.logprob or 0.0 for d in transcript.deltas)


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def serve_choices(http_request: web.Request, pipeline: RequestPipeline,
                        groups: list[list[GenerationRequest]], formatters: list[list], n: int,
                        stream: bool) -> web.StreamResponse:
    """Serve `groups` (one per prompt, each with its formatters) as one response of n choices per group.

    Usage counts each prompt once and every returned choice's tokens."""
    requests = [r for group in groups for r in group]
    flat_formatters = [f for group in formatters for f in group]
    if len(requests) == 1:
        return await serve_generation(http_request, pipeline, requests[0], flat_formatters[0], stream)
    requests = admitted(http_request, requests)
    try:
        return await _serve_many(http_request, pipeline, groups, requests, flat_formatters, n, stream)
    finally:
        close_tickets(requests)


async def _serve_many(http_request: web.Request, pipeline: RequestPipeline, groups: list[list[GenerationRequest]],
                      requests: list[GenerationRequest], flat_formatters: list, n: int,
                      stream: bool) -> web.StreamResponse:
    if stream:
        usage = _RequestUsage([g for g, group in enumerate(groups) for _ in group])
        writers = [TokenWriter(ChoiceFormatter(f, i, usage), Transcript()) for i, f in enumerate(flat_formatters)]
        return await stream_events(http_request, merged(pipeline, requests), writers, requests[0].request_id)
    tasks = [asyncio.create_task(collect(pipeline, r)) for r in requests]
    try:
        transcripts = await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # one failed: the others' generations must not run on for nobody
            task.cancel()
        # ... and they end before the client request does: its tenant is charged what they streamed.
        await asyncio.gather(*tasks, return_exceptions=True)
    bodies, prompt, start = [], 0, 0
    for group in groups:
        order = list(range(start, start + len(group)))
        if len(group) > n:
            order = sorted(order, key=lambda i: _score(transcripts[i]), reverse=True)[:n]
        group_bodies = [flat_formatters[i].response(transcripts[i]) for i in order]
        prompt += group_bodies[0]["usage"]["prompt_tokens"]
        bodies += group_bodies
        start += len(group)
    body = bodies[0]
    body["choices"] = [_with_index(b, j)["choices"][0] for j, b in enumerate(bodies)]
    body["usage"] = _usage(prompt, sum(b["usage"]["completion_tokens"] for b in bodies))
    return web.json_response(body, dumps=json_dumps)


async def merged(pipeline: RequestPipeline, requests: list[GenerationRequest]) -> AsyncIterator[GenerationEvent]:
    """The events of `requests`' generations as one stream, in the order they come, each tagged with its choice
    (the request's index); a generation's ApiError is its Failed event, and the others go on."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, request: GenerationRequest) -> None:
        events = pipeline.generate(request)
        try:
            async for event in events:
                if event.__class__ is TokenDelta:
                    event.choice = i
                else:
                    event = dataclasses.replace(event, choice=i)
                await queue.put(event)
        except ApiError as error:
            await queue.put(Failed(error, i))
        except Exception:  # a bug, not the request's fault: the choice ends with a 500 and the others go on
            log.exception("choice %d of a request failed", i)
            await queue.put(Failed(ApiError(500, "internal error while generating this choice"), i))
        finally:
            await events.aclose()
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        remaining = len(requests)
        while remaining:
            event = await queue.get()
            if event is None:
                remaining -= 1
            else:
                yield event
    finally:
        for task in tasks:  # the client left, or a choice failed before the stream opened
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _is_usage_only(frame) -> bool:
    return isinstance(frame, dict) and frame.get("choices") == [] and "usage" in frame


class _RequestUsage:
    """The usage-only chunks of a stream's choices, sent as one chunk for the whole request after the last choice
    ends: each prompt counted once, every choice's tokens."""

    def __init__(self, group_of: list[int]):
        self.group_of = group_of  # each choice's prompt
        self.frames: dict[int, dict] = {}
        self.num_open = len(group_of)

    def ended(self) -> list[dict]:
        """One choice ended: the request's usage chunk when it was the last (and usage was asked for)."""
        self.num_open -= 1
        if self.num_open or not self.frames:
            return []
        prompts = {self.group_of[i]: f["usage"]["prompt_tokens"] for i, f in self.frames.items()}
        frame = next(iter(self.frames.values()))
        frame["usage"] = _usage(sum(prompts.values()), sum(f["usage"]["completion_tokens"]
                                                           for f in self.frames.values()))
        return [frame]


class ChoiceFormatter:
    """One choice of a stream of several: its API formatter's frames tagged with its choice index, its usage-only
    chunk held back for the request's one."""

    def __init__(self, formatter, index: int, usage: _RequestUsage):
        self.formatter = formatter
        self.index = index
        self.usage = usage
        self.done_marker = formatter.done_marker
        self.stream_content_type = formatter.stream_content_type
        self.encode = formatter.encode

    def _own(self, frames: list) -> list:
        usage_only = [f for f in frames if _is_usage_only(f)]
        if usage_only:
            self.usage.frames[self.index] = usage_only[-1]
        return [_with_index(f, self.index) for f in frames if not _is_usage_only(f)]

    def token_bytes(self, delta: TokenDelta, transcript: Transcript) -> None:
        return None  # the formatter's cheap path writes choice 0's chunk

    def token_frames(self, delta: TokenDelta, transcript: Transcript) -> list:
        return self._own(self.formatter.token_frames(delta, transcript))

    def final_frames(self, finished: Finished, transcript: Transcript) -> list:
        return self._own(self.formatter.final_frames(finished, transcript)) + self.usage.ended()

    def error_frames(self, error: ApiError, transcript: Transcript) -> list:
        return self._own(self.formatter.error_frames(error, transcript)) + self.usage.ended()

    def response(self, transcript: Transcript) -> dict:
        return self.formatter.response(transcript)
