"""Prompt inputs: text or a list of typed items (and OpenAI completions' batches and token ids), validated,
tokenized and checked against the model limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, ValidationInfo, WithJsonSchema

from coordinator.apis import multimodal
from coordinator.apis.fields import check_in_vocab
from coordinator.state import CoordinatorState


def input_text(state: CoordinatorState, value: str | list, param: str) -> str:
    """A text input, or a list of typed items validated by the multimodal rules."""
    text = value if isinstance(value, str) else multimodal.text_of_items(value, param, state.media_dir)
    state.limits.check_text(text, param)
    return text


async def tokenize_input(state: CoordinatorState, value: str | list, param: str,
                         keep_last: int | None = None) -> tuple[str, list[int]]:
    """Validate, tokenize (keeping only the last `keep_last` tokens if asked) and check the prompt limit."""
    text = input_text(state, value, param)
    prompt_ids = await state.tokenizer.encode_text(text)
    if keep_last is not None:
        prompt_ids = prompt_ids[-keep_last:]
    state.limits.check_prompt(len(prompt_ids), param)
    return text, prompt_ids


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
    """One prompt of a batch, tokenized, with its text (for a token-id prompt, decoded only when asked for)."""

    token_ids: list[int]
    text: str = ""


async def tokenize_batch(state: CoordinatorState, value: str | list, param: str, with_text: bool) -> list[Prompt]:
    """Every prompt of a completion prompt, validated, tokenized and checked against the model limits;
    errors name `param`, or `param.i` for the i-th prompt of a batch."""
    batch = prompt_batch(value)
    prompts = []
    for i, item in enumerate(batch):
        where = param if len(batch) == 1 else f"{param}.{i}"
        if isinstance(item, list) and isinstance(item[0], int):
            state.limits.check_prompt(len(item), where)
            prompts.append(Prompt(item, await state.tokenizer.decode(item) if with_text else ""))
        else:
            text, ids = await tokenize_input(state, item, where)
            prompts.append(Prompt(ids, text))
    return prompts
