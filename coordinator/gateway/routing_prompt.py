"""The prompt tokens a gateway request is routed on, read from its body as each client API sends its prompt.

Only the picker reads bodies this way: the sidecar that serves the request parses and validates it fully, in its
API's error format. A body the picker cannot read routes on load alone (no tokens).
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from coordinator.requests.tokenization import PromptTokenizer

ROUTING_CHARS = 32_768  # a prompt's text past this does not sway the pick (its leading blocks decide)
CUT_TOKENS = 4  # tokens dropped at a cut: the last ones may merge differently with the text that follows


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


def _tokens(tokenizer: PromptTokenizer, prompt: str | list[int] | None, messages: list | None) -> RoutingPrompt:
    if isinstance(prompt, list):
        return RoutingPrompt(prompt)
    chat = messages is not None
    text = tokenizer.chat_text(messages) if chat else prompt
    if not text:
        return RoutingPrompt([])
    cut = len(text) > ROUTING_CHARS
    ids = tokenizer.encode_now(text[:ROUTING_CHARS], add_special_tokens=not chat)
    return RoutingPrompt(ids[:-CUT_TOKENS], True) if cut else RoutingPrompt(ids)


async def routing_tokens(tokenizer: PromptTokenizer, path: str, body: object) -> RoutingPrompt:
    """The leading prompt tokens of the request at `path` with JSON `body`, as its API would tokenize them."""
    if not isinstance(body, dict):
        return RoutingPrompt([])
    prompt, messages = prompt_of(path, body)
    if prompt is None and messages is None:
        return RoutingPrompt([])
    try:
        return await asyncio.to_thread(_tokens, tokenizer, prompt, messages)
    except Exception:  # a malformed prompt routes on load; the sidecar answers it with its API's error
        return RoutingPrompt([])
