"""The HTTP route table: one entry per route, read by the app, its middleware and the metrics."""

from __future__ import annotations

import enum
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Metrics label of a POST that matches no route (GETs of unknown paths are not counted).
UNROUTED_LABEL = "other"


class ErrorStyle(enum.Enum):
    """Which error body a route answers with."""

    OPENAI = "openai"  # {"error": {"message", "type", "param", "code"}}
    TGI = "tgi"  # {"error", "error_type"}: TGI, vLLM native, Triton, MindIE, tokenizer, /health, /metrics


@dataclass(frozen=True)
class Route:
    """One HTTP route: where it is, what serves it, its error body, its metrics label and its documented bodies."""

    method: str
    path: str  # an aiohttp pattern: `{name}` stands for one path segment
    handler: Handler
    error_style: ErrorStyle
    metrics_label: str | None = None  # None: not counted in the request metrics
    generation: bool = False  # runs a generation, so counts against request_limit.max_requests
    on_standby: bool = False  # answered by a standby coordinator too (health, liveness, metrics); see cluster/
    # For GET /openapi.json: the type the JSON body is validated into (a pydantic model, or a union of models
    # where one path serves two APIs), and the success answers (an apis.response_models.Reply).
    body_model: Any = None
    reply: Any = None

    def pattern(self) -> re.Pattern:
        parts = re.split(r"(\{[^}]+\})", self.path)
        return re.compile("".join("[^/]+" if p.startswith("{") else re.escape(p) for p in parts) + r"\Z")


class RouteTable:
    """An app's routes, looked up by path as the middleware needs them."""

    def __init__(self, routes: Iterable[Route]):
        self.routes = tuple(routes)
        keys = [(r.method, r.path) for r in self.routes]
        duplicates = sorted({k for k in keys if keys.count(k) > 1})
        if duplicates:
            raise ValueError(f"routes declared twice: {duplicates}")
        # Every request looks itself up once (RequestGate): static paths by key, no scan.
        self._static = {(r.method, r.path): r for r in self.routes if "{" not in r.path}
        self._dynamic = [(r.pattern(), r) for r in self.routes if "{" in r.path]

    def add_to(self, app: web.Application) -> None:
        for r in self.routes:
            if r.method == "GET":
                app.router.add_get(r.path, r.handler)  # answers HEAD too
            else:
                app.router.add_route(r.method, r.path, r.handler)

    def at_path(self, path: str) -> list[Route]:
        """The routes at `path`, whatever their method."""
        static = [r for (_, p), r in self._static.items() if p == path]
        return static + [r for pattern, r in self._dynamic if pattern.match(path)]

    def find(self, method: str, path: str) -> Route | None:
        route = self._static.get((method, path))
        if route is not None:
            return route
        return next((r for pattern, r in self._dynamic if r.method == method and pattern.match(path)), None)

    def error_style(self, path: str) -> ErrorStyle:
        """The style of the route at `path`; an unknown path under /v1/ is OpenAI's, any other TGI's."""
        routes = self.at_path(path)
        if routes:
            return routes[0].error_style
        return ErrorStyle.OPENAI if path.startswith("/v1/") else ErrorStyle.TGI

    def metrics_label(self, method: str, path: str) -> str | None:
        route = self.find(method, path)
        if route is not None:
            return route.metrics_label
        return UNROUTED_LABEL if method == "POST" else None


# The app's own table (the predict port's or the management port's), read by its middleware.
ROUTE_TABLE = web.AppKey("route_table", RouteTable)
