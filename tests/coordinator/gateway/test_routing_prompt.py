"""The prompt tokens a gateway request routes on: each API's prompt field, the chat template, the cut of long text."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.gateway.routing_prompt import CUT_TOKENS, FIRST_CHARS, MAX_CHARS, RoutingPrompts, prompt_of
from coordinator.requests.tokenization import PromptTokenizer


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return PromptTokenizer(model_dir)


def routing_tokens(tokenizer, path, body, held=lambda ids: 0):
    return RoutingPrompts(tokenizer).tokens(path, body, held)


@pytest.mark.parametrize("path,body,prompt", [
    ("/v1/completions", {"prompt": "hi there"}, "hi there"),
    ("/v1/completions", {"prompt": ["first", "second"]}, "first"),
    ("/v1/completions", {"prompt": [1, 2, 3]}, [1, 2, 3]),
    ("/v1/completions", {"prompt": [[4, 5], [6]]}, [4, 5]),
    ("/generate", {"inputs": "tgi"}, "tgi"),
    ("/generate", {"prompt": "vllm native"}, "vllm native"),
    ("/generate_stream", {"inputs": "tgi"}, "tgi"),
    ("/infer", {"inputs": "mindie"}, "mindie"),
    ("/v2/models/pdserve-tiny/generate", {"text_input": "triton"}, "triton"),
    ("/v1/completions", {"prompt": 7}, None),
    ("/v1/models", {}, None),
])
def test_each_apis_prompt_field_is_read(path, body, prompt):
    assert prompt_of(path, body) == (prompt, None)


def test_chat_routes_on_the_templated_messages_as_the_chat_api_tokenizes_them(tokenizer):
    messages = [{"role": "user", "content": "Hello there"}]
    ids, cut = asyncio.run(routing_tokens(tokenizer, "/v1/chat/completions", {"messages": messages}))
    assert ids == asyncio.run(tokenizer.encode_chat(messages)) and not cut


def test_a_long_prompt_no_cache_holds_routes_on_its_first_window_of_tokens(tokenizer):
    text = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(MAX_CHARS // 20))
    ids, cut = asyncio.run(routing_tokens(tokenizer, "/v1/completions", {"prompt": text}))
    full = tokenizer.encode_now(text)
    assert cut
    assert 0 < len(ids) < len(full) and full[:len(ids)] == ids
    assert len(tokenizer.encode_now(text[:FIRST_CHARS])) - len(ids) == CUT_TOKENS


def test_the_window_widens_while_a_cache_holds_the_prompt_through_its_end(tokenizer):
    text = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(MAX_CHARS // 20))
    full = tokenizer.encode_now(text)
    holds = 3 * len(tokenizer.encode_now(text[:FIRST_CHARS]))  # past the first window, inside the second
    asked = []

    def held(ids):
        asked.append(len(ids))
        return min(len(ids), holds)

    ids, cut = asyncio.run(routing_tokens(tokenizer, "/v1/completions", {"prompt": text}, held))
    assert cut and asked and full[:len(ids)] == ids
    assert len(ids) == len(tokenizer.encode_now(text[:FIRST_CHARS * 4])) - CUT_TOKENS
    widest, cut = asyncio.run(routing_tokens(tokenizer, "/v1/completions", {"prompt": text}, len))
    assert cut and widest == full[:len(widest)]  # held everywhere: as far as MAX_CHARS, no further
    assert len(widest) == len(tokenizer.encode_now(text[:MAX_CHARS])) - CUT_TOKENS


def test_a_window_tokenized_before_is_found_again_by_its_text_and_the_store_stays_bounded(tokenizer):
    prompts = RoutingPrompts(tokenizer, max_tokens=3_000)
    first = "".join(f"Shared system prompt, line {i}.\n" for i in range(400))
    ids = asyncio.run(prompts.tokens("/v1/completions", {"prompt": first + "question one"}))
    again = asyncio.run(prompts.tokens("/v1/completions", {"prompt": first + "question two"}))
    assert again == ids and (prompts.hits, prompts.misses) == (1, 1)  # the same first window
    for i in range(8):
        asyncio.run(prompts.tokens("/v1/completions", {"prompt": f"{i} " * 5000}))
    assert prompts._tokens <= 3_000


def test_a_body_without_a_readable_prompt_routes_on_load_alone(tokenizer):
    assert asyncio.run(routing_tokens(tokenizer, "/v1/chat/completions", {"messages": "not a list"})) == ([], False)
    assert asyncio.run(routing_tokens(tokenizer, "/v1/completions", None)) == ([], False)
