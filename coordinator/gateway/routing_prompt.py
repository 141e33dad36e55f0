"""The prompt tokens a gateway request is routed on, read from its body as each client API sends its prompt.

Only the picker reads bodies this way: the sidecar that serves the request parses and validates it fully, in its
API's error format. A body the picker cannot read routes on load alone (no tokens).

Tokenizing is most of a pick's cost, so a long prompt is tokenized only as far as a cache could hold it: its first
FIRST_CHARS, then a window four times longer while some worker holds the prefix through the window's end (minus
HELD_MARGIN tokens, its last block), up to MAX_CHARS. A prompt no cache holds costs one short window.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import NamedTuple

from coordinator.requests.tokenization import PromptTokenizer

FIRST_CHARS = 4_096
MAX_CHARS = 1_048_576  # a prompt's text past this does not sway the pick
HELD_MARGIN = 256  # tokens: a cache holding the window but its last block (of up to 256 positions) holds it
CUT_TOKENS = 4  # tokens dropped at a cut: the last ones may merge differently with the text that follows
INLINE_CHARS = 8_192  # a window this short is tokenized on the event loop (a thread hop costs more)


def prompt_of(path: str, body: dict) -> tuple[str | list[int] | None, list | None]:
    """(the prompt as text or token ids, or the chat messages) of a request body; (None, None) when it has none."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        return None, messages if isinstance(messages, list) else None
    if path.endswith("/completions"):
        prompt = body.get("prompt")
    elif path.startswith("/v2/models/"):
        prompt = body.get("text_input")
    else:  # TGI /generate, /generate_stream, /; MindIE /infer (`inputs`); vLLM native /generate (`prompt`)
        prompt = body.get("inputs", body.get("prompt"))
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        prompt = prompt[0]  # a batch routes on its first prompt
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        return prompt, None
    return None, None


class RoutingPrompt(NamedTuple):
    """The leading tokens a request routes on; `cut`: its prompt goes on past them."""

    token_ids: list[int]
    cut: bool = False


def _window(tokenizer: PromptTokenizer, text: str, chars: int, chat: bool) -> RoutingPrompt:
    ids = tokenizer.encode_now(text[:chars], add_special_tokens=not chat)
    return RoutingPrompt(ids[:-CUT_TOKENS], True) if len(text) > chars else RoutingPrompt(ids)


async def _tokenized(tokenizer: PromptTokenizer, text: str, chars: int, chat: bool) -> RoutingPrompt:
    if min(chars, len(text)) <= INLINE_CHARS:
        return _window(tokenizer, text, chars, chat)
    return await asyncio.to_thread(_window, tokenizer, text, chars, chat)


async def routing_tokens(tokenizer: PromptTokenizer, path: str, body: object,
                         held: Callable[[list[int]], int] = lambda ids: 0) -> RoutingPrompt:
    """The leading prompt tokens of the request at `path` with JSON `body`, as its API would tokenize them;
    `held(ids)`: the most leading tokens of `ids` any worker's cache holds (the window widens while they reach its
    end)."""
    if not isinstance(body, dict):
        return RoutingPrompt([])
    prompt, messages = prompt_of(path, body)
    if isinstance(prompt, list):
        return RoutingPrompt(prompt)
    try:
        chat = messages is not None
        text = await asyncio.to_thread(tokenizer.chat_text, messages) if chat else prompt
        if not text:
            return RoutingPrompt([])
        chars = FIRST_CHARS
        routed = await _tokenized(tokenizer, text, chars, chat)
        while routed.cut and chars < MAX_CHARS and held(routed.token_ids) >= len(routed.token_ids) - HELD_MARGIN:
            chars *= 4
            routed = await _tokenized(tokenizer, text, chars, chat)
        return routed
    except Exception:  # a malformed prompt routes on load; the sidecar answers it with its API's error
        return RoutingPrompt([])
