"""POST /v1/tokenizer: how many tokens a text is, and which."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inputs: str = Field(min_length=1)


def tokenize_body(token_texts: list[str]) -> dict:
    return {"token_number": len(token_texts), "tokens": token_texts}
