"""HTTP handlers: each parses with its API adapter, tokenizes, and hands off to serving."""

from __future__ import annotations

import asyncio

from aiohttp import web

from coordinator.apis import openai_chat, openai_completions
from coordinator.apis.openai_common import check_model, parse_request, read_json
from coordinator.apis.operations import health_body, models_body
from coordinator.request import GenerationRequest
from coordinator.serving import serve_generation
from coordinator.state import STATE


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = parse_request(openai_chat.ChatCompletionRequest, await read_json(request))
    check_model(body.model, state.model_name)
    messages = body.template_messages()
    state.limits.check_text("".join(m["content"] for m in messages), "messages")
    prompt_ids = await state.tokenizer.encode_chat(messages)
    state.limits.check_prompt(len(prompt_ids), "messages")
    gen = GenerationRequest(openai_chat.new_request_id(), prompt_ids, body.sampling(), body.max_tokens)
    formatter = openai_chat.ChatFormatter(gen.request_id, gen.created, state.model_name, state.full_text,
                                          body.return_token_ids, prompt_ids, state.tokenizer.token_text)
    return await serve_generation(request, state.pipeline, gen, formatter, body.stream)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = parse_request(openai_completions.CompletionRequest, await read_json(request))
    check_model(body.model, state.model_name)
    state.limits.check_text(body.prompt, "prompt")
    prompt_ids = await state.tokenizer.encode_text(body.prompt)
    state.limits.check_prompt(len(prompt_ids), "prompt")
    gen = GenerationRequest(openai_completions.new_request_id(), prompt_ids, body.sampling(), body.max_tokens)
    formatter = openai_completions.CompletionFormatter(gen.request_id, gen.created, state.model_name,
                                                       state.full_text, body.return_token_ids, prompt_ids,
                                                       state.tokenizer.token_text)
    return await serve_generation(request, state.pipeline, gen, formatter, body.stream)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(models_body(state.model_name, state.started_at, state.limits.max_seq_len))


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]

    async def probe(address: str, role: str) -> str:
        try:
            await state.client.health(address, role, timeout=2.0)
            return "healthy"
        except Exception:  # any failure to answer means not ready to serve
            return "unreachable"

    groups = {"prefill": state.router.prefill, "decode": state.router.decode}
    results = {
        role: dict(zip(addrs, await asyncio.gather(*(probe(a, role) for a in addrs))))
        for role, addrs in groups.items()
    }
    status, body = health_body(results)
    return web.json_response(body, status=status)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
