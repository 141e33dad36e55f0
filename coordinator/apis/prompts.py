"""Prompt inputs: text or a list of typed items, validated, tokenized and checked against the model limits."""

from __future__ import annotations

from coordinator.apis import multimodal
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
