"""The predict port's routes: every client API's own entries, in one table."""

from __future__ import annotations

from coordinator.apis import (
    generate,
    mindie,
    openai_chat,
    openai_completions,
    openapi,
    operations,
    tgi,
    tokenizer,
    triton,
)
from coordinator.http.route_table import RouteTable

PREDICT_ROUTES = RouteTable([
    *openai_chat.ROUTES,
    *openai_completions.ROUTES,
    *operations.ROUTES,
    *openapi.ROUTES,
    *generate.ROUTES,
    *tgi.ROUTES,
    *tokenizer.ROUTES,
    *mindie.ROUTES,
    *triton.ROUTES,
])
