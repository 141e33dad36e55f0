"""HTTP handlers: each parses with its API adapter, tokenizes, and hands off to serving."""

from __future__ import annotations

import dataclasses

from aiohttp import web

from coordinator.apis import mindie, multimodal, openai_chat, openai_completions, tgi, tokenizer, triton, vllm_native
from coordinator.apis.fields import new_id, parse_request, read_json
from coordinator.apis.openai_common import check_model
from coordinator.apis.operations import health_body, models_body
from coordinator.errors import ApiError
from coordinator.choices import fan_out, serve_choices
from coordinator.request import GenerationRequest
from coordinator.serving import serve_generation
from coordinator.state import STATE


def input_text(state, value: str | list, param: str) -> str:
    """A text input, or a list of typed items validated by the multimodal rules."""
    text = value if isinstance(value, str) else multimodal.text_of_items(value, param, state.media_dir)
    state.limits.check_text(text, param)
    return text


async def tokenize_input(state, value: str | list, param: str, keep_last: int | None = None) -> tuple[str, list[int]]:
    """Validate, tokenize (keeping only the last `keep_last` tokens if asked) and check the prompt limit."""
    text = input_text(state, value, param)
    prompt_ids = await state.tokenizer.encode_text(text)
    if keep_last is not None:
        prompt_ids = prompt_ids[-keep_last:]
    state.limits.check_prompt(len(prompt_ids), param)
    return text, prompt_ids


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = parse_request(openai_chat.ChatCompletionRequest, await read_json(request))
    check_model(body.model, state.model_name)
    messages = body.template_messages(lambda parts, param: multimodal.text_of_items(parts, param, state.media_dir))
    state.limits.check_text("".join(m["content"] for m in messages), "messages")
    prompt_ids = await state.tokenizer.encode_chat(messages, body.template_tools())
    state.limits.check_prompt(len(prompt_ids), "messages")
    gen = GenerationRequest(openai_chat.new_request_id(), prompt_ids, ranked_sampling(body), body.max_tokens)

    def formatter():
        f = openai_chat.ChatFormatter(gen.request_id, gen.created, state.model_name, state.full_text,
                                      body.return_token_ids, prompt_ids, state.tokenizer.token_text,
                                      body.stream_options, parse_tools=body.parse_tools)
        f.show_logprobs = body.logprobs_count() is not None
        return f

    return await _serve_openai(request, state, body, gen, formatter)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = parse_request(openai_completions.CompletionRequest, await read_json(request))
    check_model(body.model, state.model_name)
    prompt, prompt_ids = await tokenize_input(state, body.prompt, "prompt")
    gen = GenerationRequest(openai_completions.new_request_id(), prompt_ids, ranked_sampling(body), body.max_tokens)

    def formatter():
        f = openai_completions.CompletionFormatter(gen.request_id, gen.created, state.model_name, state.full_text,
                                                   body.return_token_ids, prompt_ids, state.tokenizer.token_text,
                                                   body.stream_options)
        f.echo_text = prompt if body.echo else ""
        f.show_logprobs = body.logprobs_count() is not None
        return f

    return await _serve_openai(request, state, body, gen, formatter)


def ranked_sampling(body):
    """The request's sampling; with best_of > n, logprobs are computed to rank the candidates."""
    sampling = body.sampling()
    if body.num_generations > body.n and sampling.logprobs is None:
        sampling = dataclasses.replace(sampling, logprobs=0)
    return sampling


async def _serve_openai(request, state, body, gen, make_formatter) -> web.StreamResponse:
    requests = fan_out(gen, body.num_generations)
    formatters = [make_formatter() for _ in requests]
    return await serve_choices(request, state.pipeline, requests, formatters, body.n, body.stream)


async def generate(request: web.Request) -> web.StreamResponse:
    """/generate serves two APIs: a body with `inputs` is TGI, one with `prompt` is vLLM."""
    body = await read_json(request)
    if not isinstance(body, dict) or ("inputs" in body) == ("prompt" in body):
        raise ApiError(400, "a /generate body needs exactly one of `inputs` (TGI) or `prompt` (vLLM)")
    if "inputs" in body:
        if body.get("stream"):
            raise ApiError(400, "stream: use /generate_stream (or POST /) to stream a TGI request", param="stream")
        return await _tgi(request, body, stream=False, native_shapes=False)
    return await _vllm(request, body)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    if isinstance(body, dict) and body.get("stream") is False:
        raise ApiError(400, "stream: /generate_stream always streams; omit stream or send true", param="stream")
    return await _tgi(request, body, stream=True, native_shapes=False)


async def tgi_compat(request: web.Request) -> web.StreamResponse:
    """POST /: what TGI clients (huggingface_hub.InferenceClient) call; `stream` picks the mode."""
    body = await read_json(request)
    stream = bool(body.get("stream")) if isinstance(body, dict) else False
    return await _tgi(request, body, stream=stream, native_shapes=True)


async def _tgi(request: web.Request, body, stream: bool, native_shapes: bool) -> web.StreamResponse:
    state = request.app[STATE]
    if isinstance(body, dict):
        body = {**body, "stream": stream}
    req = parse_request(tgi.TgiRequest, body)
    text, prompt_ids = await tokenize_input(state, req.inputs, "inputs", keep_last=req.parameters.truncate)
    sampling = req.parameters.sampling()
    gen = GenerationRequest(tgi.new_request_id(), prompt_ids, sampling, req.parameters.max_new_tokens)
    formatter = tgi.TgiFormatter(req, text, prompt_ids, sampling.seed, state.full_text,
                                 state.tokenizer.token_text, state.tokenizer.special_ids,
                                 list_ids=not native_shapes, wrap_in_list=native_shapes)
    return await serve_generation(request, state.pipeline, gen, formatter, stream)


async def _vllm(request: web.Request, body: dict) -> web.StreamResponse:
    state = request.app[STATE]
    req = parse_request(vllm_native.VllmGenerateRequest, body)
    vllm_native.check_lora(req.model, state.model_name)
    text, prompt_ids = await tokenize_input(state, req.prompt, "prompt")
    gen = GenerationRequest(new_id("vllm"), prompt_ids, req.sampling(), req.max_tokens)
    formatter = vllm_native.VllmFormatter(text, state.full_text)
    return await serve_generation(request, state.pipeline, gen, formatter, req.stream)


async def infer(request: web.Request) -> web.StreamResponse:
    """MindIE's native /infer."""
    state = request.app[STATE]
    req = parse_request(mindie.MindieRequest, await read_json(request))
    _, prompt_ids = await tokenize_input(state, req.inputs, "inputs")
    params = req.parameters
    sampling = params.sampling()
    gen = GenerationRequest(new_id("infer"), prompt_ids, sampling, params.max_new_tokens, timeout_s=params.timeout,
                            priority=params.priority)
    formatter = mindie.MindieFormatter(params, sampling.seed, state.full_text)
    return await serve_generation(request, state.pipeline, gen, formatter, req.stream)


async def triton_generate(request: web.Request) -> web.StreamResponse:
    """Triton text generation; `/generate_stream` streams."""
    state = request.app[STATE]
    triton.check_model(request.match_info["model"], state.model_name)
    req = parse_request(triton.TritonGenerateRequest, await read_json(request))
    _, prompt_ids = await tokenize_input(state, req.text_input, "text_input")
    params = req.parameters
    request_id = req.id or new_id("triton")
    gen = GenerationRequest(request_id, prompt_ids, params.sampling(), params.max_new_tokens, timeout_s=params.timeout,
                            priority=params.priority)
    formatter = triton.TritonFormatter(request_id, state.model_name, params, state.full_text)
    stream = request.path.endswith("/generate_stream")
    return await serve_generation(request, state.pipeline, gen, formatter, stream)


async def triton_infer(request: web.Request) -> web.Response:
    """Triton token inference: token ids in, token ids out."""
    state = request.app[STATE]
    triton.check_model(request.match_info["model"], state.model_name)
    req = parse_request(triton.TritonInferRequest, await read_json(request))
    prompt_ids = req.inputs[0].data
    vocab = len(state.tokenizer.tokenizer)
    if max(prompt_ids) >= vocab:
        raise ApiError(400, f"inputs.0.data: token id {max(prompt_ids)} is outside the vocabulary [0, {vocab})",
                       param="inputs")
    state.limits.check_prompt(len(prompt_ids), "inputs.0.data")
    params = req.parameters
    request_id = req.id or new_id("triton")
    gen = GenerationRequest(request_id, list(prompt_ids), params.sampling(), params.max_new_tokens,
                            timeout_s=params.timeout, priority=params.priority)
    return await serve_generation(request, state.pipeline, gen, triton.TritonTokenFormatter(request_id, req), False)


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = parse_request(tokenizer.TokenizeRequest, await read_json(request))
    state.limits.check_text(req.inputs, "inputs")
    ids = await state.tokenizer.encode_text(req.inputs)
    return web.json_response(tokenizer.tokenize_body([state.tokenizer.token_text(i) for i in ids]))


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(models_body(state.model_name, state.started_at, state.limits.max_seq_len))


async def health(request: web.Request) -> web.Response:
    """Every known instance probed now; 200 while at least one prefill and one decode can serve."""
    state = request.app[STATE]
    await state.health_monitor.check_all()
    status, body = health_body(state.registry.snapshot())
    return web.json_response(body, status=status)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/generate", generate)
    app.router.add_post("/generate_stream", generate_stream)
    app.router.add_post("/", tgi_compat)
    app.router.add_post("/v1/tokenizer", tokenize)
    app.router.add_post("/infer", infer)
    app.router.add_post("/v2/models/{model}/generate", triton_generate)
    app.router.add_post("/v2/models/{model}/generate_stream", triton_generate)
    app.router.add_post("/v2/models/{model}/infer", triton_infer)
