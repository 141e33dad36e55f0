"""POST /v1/tokenizer: how many tokens a text is, and which."""

from __future__ import annotations

import asyncio

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from coordinator.apis.fields import read_request
from coordinator.apis.response_models import Reply, TokenizeResponse
from coordinator.http.route_table import ErrorStyle, Route
from coordinator.state import STATE


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inputs: str = Field(min_length=1)


def tokenize_body(token_texts: list[str]) -> dict:
    return {"token_number": len(token_texts), "tokens": token_texts}


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = await read_request(request, TokenizeRequest)
    state.limits.check_text(req.inputs, "inputs")
    ids = await state.tokenizer.encode_text(req.inputs)
    # One decode per token: off the event loop for a long input (100,000 tokens took 0.2 s there).
    texts = await asyncio.to_thread(lambda: [state.tokenizer.token_text(i) for i in ids]) if len(ids) > 512 \
        else [state.tokenizer.token_text(i) for i in ids]
    return web.json_response(tokenize_body(texts))


# A /v1/ path that answers in TGI's error format, as MindIE's tokenizer does.
ROUTES = [Route("POST", "/v1/tokenizer", tokenize, ErrorStyle.TGI, "tokenizer", body_model=TokenizeRequest,
                reply=Reply(json=TokenizeResponse))]
