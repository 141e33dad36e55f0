"""Prompt inputs: text or a list of typed items (and OpenAI completions' batches and token ids), validated,
tokenized and checked against the model limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, ValidationInfo, WithJsonSchema

from coordinator.apis import multimodal
from coordinator.apis.fields import check_in_vocab
from coordinator.errors import ApiError
from coordinator.requests.media import place_media, truncate_with_media
from coordinator.requests.request import MediaInput
from coordinator.state import CoordinatorState


def items_prompt(state: CoordinatorState, value: list, param: str, require_text: bool = True) -> multimodal.ItemsPrompt:
    """A list of typed items validated by the multimodal rules, for the served model."""
    images = state.tokenizer.images
    return multimodal.parse_items(value, param, state.media_dir, images.placeholder if images is not None else None,
                                  require_text)


async def with_media(state: CoordinatorState, prompt_ids: list[int], refs: tuple[multimodal.MediaRef, ...],
                     param: str) -> tuple[list[int], tuple[MediaInput, ...]]:
    """The prompt with its images fetched and their placeholders expanded; for a vision-language model, a
    placeholder without its image is a 400 too (nothing to do for a text model)."""
    images = state.tokenizer.images
    if images is None:
        return prompt_ids, ()
    files = await state.media.fetch_all(refs) if refs else []
    return place_media(prompt_ids, refs, files, images, param)


async def tokenize_input(state: CoordinatorState, value: str | list, param: str,
                         keep_last: int | None = None) -> Prompt:
    """Validate, tokenize (keeping only the last `keep_last` tokens if asked), place the images and check the
    prompt limit (image positions included)."""
    items = None if isinstance(value, str) else items_prompt(state, value, param)
    text = value if items is None else items.text
    state.limits.check_text(text, param)
    prompt_ids = await state.tokenizer.encode_text(text)
    prompt_ids, media = await with_media(state, prompt_ids, items.media if items is not None else (), param)
    if keep_last is not None:
        prompt_ids, media = truncate_with_media(prompt_ids, media, keep_last, param)
    state.limits.check_prompt(len(prompt_ids), param)
    return Prompt(prompt_ids, text, media)


# OpenAI completions: a string, a list of strings (a batch), a list of token ids, a list of lists of
# token ids (a batch), or (the MindIE API, docs/compatibility.md) a list of typed items, which is one prompt.
_PROMPT_FORMS = {str: "strings", int: "token ids", list: "lists of token ids", dict: "typed items"}


def _form(item: Any) -> str:
    if isinstance(item, bool) or type(item) not in _PROMPT_FORMS:
        raise ValueError(f"list items must be strings, token ids, lists of token ids or typed items "
                         f"{{\"type\": ...}}; got {type(item).__name__}")
    return _PROMPT_FORMS[type(item)]


def _completion_prompt(value: Any, info: ValidationInfo) -> str | list:
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ValueError("must be a string, or a non-empty list of strings, token ids, lists of token ids "
                         "or typed items")
    forms = {_form(item) for item in value}
    if len(forms) > 1:
        raise ValueError(f"a list must hold one form, not a mix of {' and '.join(sorted(forms))}")
    form = forms.pop()
    if form == "token ids":
        check_in_vocab(value, info)
    elif form == "lists of token ids":
        for i, ids in enumerate(value):
            if not ids or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise ValueError(f"item {i} must be a non-empty list of token ids")
            check_in_vocab(ids, info)
    return value


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
CompletionPrompt = Annotated[Any, AfterValidator(_completion_prompt), WithJsonSchema({"anyOf": [
    {"type": "string"},
    {"type": "array", "items": {"type": "string"}, "minItems": 1},
    _TOKEN_IDS,
    {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
    {"type": "array", "items": {"type": "object", "required": ["type"]}, "minItems": 1},
]})]


def prompt_batch(value: str | list) -> list[str | list]:
    """A validated completion prompt as the list of its prompts: one choice group each."""
    if isinstance(value, str) or isinstance(value[0], (int, dict)):
        return [value]
    return list(value)


@dataclass(frozen=True)
class Prompt:
    """One prompt, tokenized, with its text (for a token-id prompt, decoded only when asked for) and images."""

    token_ids: list[int]
    text: str = ""
    media: tuple[MediaInput, ...] = ()


async def tokenize_batch(state: CoordinatorState, value: str | list, param: str, with_text: bool) -> list[Prompt]:
    """Every prompt of a completion prompt, validated, tokenized and checked against the model limits;
    errors name `param`, or `param.i` for the i-th prompt of a batch."""
    batch = prompt_batch(value)
    prompts = []
    for i, item in enumerate(batch):
        where = param if len(batch) == 1 else f"{param}.{i}"
        if isinstance(item, list) and isinstance(item[0], int):
            images = state.tokenizer.images
            if images is not None and images.token_id in item:
                raise ApiError(400, f"{where}: token id {images.token_id} is the image placeholder; send images as "
                                    "typed items", param=where)
            state.limits.check_prompt(len(item), where)
            prompts.append(Prompt(item, await state.tokenizer.decode(item) if with_text else ""))
        else:
            prompts.append(await tokenize_input(state, item, where))
    return prompts
