"""`n` / `best_of`, and batches of prompts: several generations answered as one response.

A request is one group of generations per prompt (one prompt unless a completion sends a batch).
Each generation of a group has its own seed (the request's seed + i), so choices differ when
sampling and stay reproducible. With best_of > n, each group's n with the highest cumulative
logprob are returned. Choice `j` of prompt `g` is choice index g * n + j, as OpenAI numbers them.
Streams interleave the choices' chunks, each tagged with its choice index, and end with one
usage-only chunk for the whole request when the client asked for usage.
"""

from __future__ import annotations

import asyncio
import dataclasses

from aiohttp import web

from coordinator.errors import ApiError
from coordinator.metrics import METRICS, api_label
from coordinator.pipeline import RequestPipeline
from coordinator.request import GenerationRequest, TokenDelta
from coordinator.serving import Transcript, json_dumps, record, serve_generation
from coordinator.sse import open_stream

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


async def _collect(pipeline: RequestPipeline, request: GenerationRequest) -> Transcript:
    transcript = Transcript()
    events = pipeline.generate(request)
    try:
        async for event in events:
            record(transcript, event)
    finally:
        await events.aclose()
    return transcript


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
    if stream:
        group_of = [g for g, group in enumerate(groups) for _ in group]
        return await _stream_choices(http_request, pipeline, requests, flat_formatters, group_of)
    tasks = [asyncio.create_task(_collect(pipeline, r)) for r in requests]
    try:
        transcripts = await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # one failed: the others' generations must not run on for nobody
            task.cancel()
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


def _is_usage_only(frame) -> bool:
    return isinstance(frame, dict) and frame.get("choices") == [] and "usage" in frame


async def _stream_choices(http_request, pipeline, requests, formatters, group_of: list[int]) -> web.StreamResponse:
    queue: asyncio.Queue = asyncio.Queue()
    usage_frames: dict[int, dict] = {}  # each choice's usage-only chunk, sent as one for the request

    async def pump(i: int, request: GenerationRequest) -> None:
        events = pipeline.generate(request)
        try:
            async for event in events:
                await queue.put((i, event))
        except ApiError as error:
            await queue.put((i, error))
        finally:
            await events.aclose()
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    transcripts = [Transcript() for _ in requests]
    response: web.StreamResponse | None = None
    remaining = len(requests)
    try:
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, ApiError):
                if response is None:
                    raise item
                http_request.app[METRICS].fail(api_label(http_request), item.status)
                frames = formatters[i].error_frames(item, transcripts[i])
            else:
                if response is None:
                    response = await open_stream(http_request, formatters[0].stream_content_type)
                record(transcripts[i], item)
                frames = (formatters[i].token_frames(item, transcripts[i]) if isinstance(item, TokenDelta)
                          else formatters[i].final_frames(item, transcripts[i]))
            for frame in frames:
                if _is_usage_only(frame):
                    usage_frames[i] = frame
                else:
                    await response.write(formatters[i].encode(_with_index(frame, i)))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if usage_frames:
        prompts = {group_of[i]: f["usage"]["prompt_tokens"] for i, f in usage_frames.items()}
        frame = next(iter(usage_frames.values()))
        frame["usage"] = _usage(sum(prompts.values()), sum(f["usage"]["completion_tokens"]
                                                           for f in usage_frames.values()))
        await response.write(formatters[0].encode(frame))
    if formatters[0].done_marker is not None:
        await response.write(formatters[0].encode(formatters[0].done_marker))
    await response.write_eof()
    return response
