"""The prompt tokens a gateway request is routed on, read from its body as each client API sends its prompt.

Only the picker reads bodies this way: the sidecar that serves the request parses and validates it fully, in its
API's error format. A body the picker cannot read routes on load alone (no tokens).

Tokenizing is most of a pick's cost, so a long prompt is tokenized only as far as a cache could hold it: its first
FIRST_CHARS, then a window four times longer while some worker holds the prefix through the window's end (minus
HELD_MARGIN tokens, its last block), up to MAX_CHARS. A prompt no cache holds costs one short window; a window
tokenized before (a prefix a cache holds was mostly routed here before) costs a digest of its text.
"""

from __future__ import annotations

import asyncio
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import xxhash

from coordinator.requests.tokenization import PromptTokenizer

FIRST_CHARS = 4_096
MAX_CHARS = 16_384  # a prompt's text past this does not sway the pick (each window costs hashing in the KV index too)
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


def _tokenize_window(tokenizer: PromptTokenizer, text: str, chars: int, chat: bool) -> list[int]:
    ids = tokenizer.encode_now(text[:chars], add_special_tokens=not chat)
    return ids[:-CUT_TOKENS] if len(text) > chars else ids


class RoutingPrompts:
    """The routing prompt of each gateway request, with the windows already tokenized kept by their text's digest
    (bounded by `max_tokens`, least recently used out): a window widens only where a cache holds the prefix, so
    mostly for a prefix seen before."""

    def __init__(self, tokenizer: PromptTokenizer, max_tokens: int = 4_000_000):
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self._windows: OrderedDict[tuple[bool, int, int], array] = OrderedDict()
        self._tokens = 0
        self.hits = self.misses = 0

    async def tokens(self, path: str, body: object,
                     held: Callable[[list[int]], int] = lambda ids: 0) -> RoutingPrompt:
        """The leading prompt tokens of the request at `path` with JSON `body`, as its API would tokenize them;
        `held(ids)`: the most leading tokens of `ids` any worker's cache holds (the window widens while they reach
        its end)."""
        if not isinstance(body, dict):
            return RoutingPrompt([])
        prompt, messages = prompt_of(path, body)
        if isinstance(prompt, list):
            return RoutingPrompt(prompt)
        try:
            chat = messages is not None
            text = await asyncio.to_thread(self.tokenizer.chat_text, messages) if chat else prompt
            if not text:
                return RoutingPrompt([])
            chars = FIRST_CHARS
            ids = await self._window(text, chars, chat)
            while len(text) > chars and chars < MAX_CHARS and held(ids) >= len(ids) - HELD_MARGIN:
                chars *= 4
                ids = await self._window(text, chars, chat)
            return RoutingPrompt(ids, len(text) > chars)
        except Exception:  # a malformed prompt routes on load; the sidecar answers it with its API's error
            return RoutingPrompt([])

    async def _window(self, text: str, chars: int, chat: bool) -> list[int]:
        key = (chat, min(chars, len(text)), xxhash.xxh3_64_intdigest(text[:chars].encode("utf-8", "surrogatepass")))
        found = self._windows.get(key)
        if found is not None:
            self._windows.move_to_end(key)
            self.hits += 1
            return found.tolist()
        self.misses += 1
        if min(chars, len(text)) <= INLINE_CHARS:
            ids = _tokenize_window(self.tokenizer, text, chars, chat)
        else:
            ids = await asyncio.to_thread(_tokenize_window, self.tokenizer, text, chars, chat)
        self._keep(key, array("l", ids))
        return ids

    def _keep(self, key: tuple[bool, int, int], ids: array) -> None:
        if key in self._windows or len(ids) > self.max_tokens:
            return
        self._windows[key] = ids
        self._tokens += len(ids)
        while self._tokens > self.max_tokens:
            _, dropped = self._windows.popitem(last=False)
            self._tokens -= len(dropped)
