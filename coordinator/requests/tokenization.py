"""Text and chat messages to prompt token ids, with the model's own tokenizer and template.

The coordinator does not import torch: transformers' Auto classes do (through their model configs), which cost
every coordinator a second or more of start-up and memory it never uses. The tokenizer is loaded by the class
its tokenizer_config.json names, and config.json read as plain JSON; a vision-language model's processor is the
exception (AutoProcessor), loaded only for such a model.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace

import transformers

from coordinator.requests.pretoken_cache import PretokenCache
from coordinator.requests.trace import note_tokenized


# Text up to this long is tokenized on the event loop (tens of microseconds, less than a thread hop costs).
INLINE_CHARS = 2048


class ImageTokens:
    """How a vision-language model lays an image into its prompt: the placeholder its template writes (one token),
    which its processor expands into one position per image token."""

    def __init__(self, model_dir: Path | str, tokenizer):
        from transformers import AutoProcessor  # its import costs a text model's coordinator 2 s of start-up

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.placeholder: str = self.processor.image_token
        self.token_id: int = tokenizer.convert_tokens_to_ids(self.placeholder)

    def positions(self, width: int, height: int) -> int:
        """Prompt positions the model gives an image of this size."""
        counted = self.processor._get_num_multimodal_tokens(image_sizes=[(height, width)])
        return int(counted["num_image_tokens"][0])


# (model_type, tokenizer_class) pairs for which AutoTokenizer loads exactly the named class (it may choose another
# by model_type, e.g. qwen2's own, or by the tokenizer file, e.g. a Llama-named byte-level one): checked in
# tests/coordinator/requests/test_tokenization.py. Any other checkpoint goes through AutoTokenizer, torch and all.
DIRECT_TOKENIZERS = {("llama", "TokenizersBackend")}


def load_tokenizer(model_dir: Path | str):
    """The checkpoint's tokenizer as AutoTokenizer loads it; without importing torch where the class is known to be
    the one named (DIRECT_TOKENIZERS)."""
    folder = Path(model_dir)
    tokenizer_config = folder / "tokenizer_config.json"
    named = json.loads(tokenizer_config.read_text()).get("tokenizer_class") if tokenizer_config.is_file() else None
    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    if (model_type, named) in DIRECT_TOKENIZERS:
        return getattr(transformers, named).from_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)


def read_model_config(model_dir: Path | str) -> SimpleNamespace:
    """config.json with attribute access, as the coordinator reads it (sizes, limits, vision_config), nested
    sections too; a key the file leaves out is absent (readers give their default)."""
    return json.loads((Path(model_dir) / "config.json").read_text(), object_hook=lambda d: SimpleNamespace(**d))


class PromptTokenizer:
    """Tokenizes short text inline with the Rust tokenizer, and long text off the event loop, so a 4 MB
    prompt never stalls other requests."""

    def __init__(self, model_dir: Path | str):
        self.tokenizer = load_tokenizer(model_dir)
        config = read_model_config(model_dir)
        text_config = getattr(config, "text_config", None) or config  # a vision-language model's language model
        if not all(hasattr(text_config, key) for key in ("vocab_size", "max_position_embeddings")):
            # Left to the model class's defaults (gemma-3's text_config, GPT-2's n_positions): AutoConfig knows them.
            config = transformers.AutoConfig.from_pretrained(model_dir)
            text_config = config.get_text_config()
        self.model_config = config  # the checkpoint's own (LoRA adapters are checked against its projections)
        self.max_position_embeddings = int(getattr(text_config, "max_position_embeddings", 1 << 30))
        # The model's logits have one row per id of its embedding, which may be wider than the tokenizer.
        self.vocab_size = int(getattr(text_config, "vocab_size", None) or len(self.tokenizer))
        self.special_ids = frozenset(self.tokenizer.all_special_ids)
        # The fast tokenizer's Rust core, when there is one: the same ids without the Python wrapper's cost.
        self._rust = getattr(self.tokenizer, "backend_tokenizer", None)
        # Its ids for the text of known tokenizers, from a cache of pre-tokens: no Encoding built, no Rust regex.
        self._pretokens = PretokenCache(self._rust) if self._rust is not None else None
        # A vision-language model's image placeholder and counts; None: a text model.
        self.images = ImageTokens(model_dir, self.tokenizer) if hasattr(config, "vision_config") else None

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprobs report it."""
        return self.tokenizer.decode([token_id])

    async def decode(self, token_ids: list[int]) -> str:
        return await asyncio.to_thread(self.tokenizer.decode, token_ids)

    async def encode_text(self, text: str) -> list[int]:
        started = time.monotonic()
        if len(text) > INLINE_CHARS:
            ids = await asyncio.to_thread(self.encode_now, text)
        else:
            ids = self.encode_now(text)
        note_tokenized(started)
        return ids

    def encode_now(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._rust is not None:
            ids = self._pretokens.encode(text, add_special_tokens)
            if ids is not None:
                return ids
            return self._rust.encode(text, add_special_tokens=add_special_tokens).ids
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    async def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                          resume: str | None = None) -> list[int]:
        """The template's generation prompt; with `resume`, followed by that partial reply's tokens, so the
        output continues the assistant's turn (no end-of-turn marker after it)."""
        def run() -> list[int]:
            ids = self.encode_now(self.chat_text(messages, tools), add_special_tokens=False)
            # Tokenized apart, as the model generated it: no token merges across the turn's header.
            return ids + self.continuation_ids(resume) if resume else ids

        started = time.monotonic()
        ids = await asyncio.to_thread(run)
        note_tokenized(started)
        return ids

    def chat_text(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The chat template's text for `messages`, ending with the generation prompt (blocking)."""
        return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)

    def continuation_ids(self, text: str) -> list[int]:
        """A partial reply's tokens, as `encode_chat` appends them (no special tokens)."""
        return self.encode_now(text, add_special_tokens=False)
