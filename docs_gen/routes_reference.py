"""The HTTP route reference: the predict port's and the management port's route tables, entry by entry."""

from __future__ import annotations

from coordinator.http.management import MANAGEMENT_ROUTES
from coordinator.http.route_table import ErrorStyle, Route, RouteTable
from coordinator.http.routes import PREDICT_ROUTES
from docs_gen.markdown import banner, table

# The API a handler's module serves; a route from a module missing here fails the generation, naming it.
API_OF_MODULE = {
    "coordinator.apis.openai_chat": "OpenAI chat",
    "coordinator.apis.openai_completions": "OpenAI completions (vLLM flavour)",
    "coordinator.apis.operations": "operations",
    "coordinator.apis.openapi": "OpenAPI 3.1 document",
    "coordinator.apis.generate": "TGI (body with `inputs`) or vLLM native (body with `prompt`)",
    "coordinator.apis.tgi": "TGI",
    "coordinator.apis.tokenizer": "tokenizer",
    "coordinator.apis.mindie": "MindIE native",
    "coordinator.apis.triton": "Triton",
    "coordinator.http.management": "management",
    "coordinator.gateway.sidecar_directory": "management (gateway sidecars)",
}

ERROR_BODY = {
    ErrorStyle.OPENAI: '`{"error": {"message", "type", "param", "code"}, "error_info": {"code", "message"}}`',
    ErrorStyle.TGI: '`{"error", "error_type"}`',
}

INTRO = """# HTTP routes

Every route of the coordinator's two ports, from their route tables (`coordinator/http/routes.py`,
`coordinator/http/management.py`). The error body is the one every error of that route answers with (4xx and 5xx, a
missing API key's 401 included); a path that matches no route takes OpenAI's under `/v1/`, else TGI's.
*max_requests* marks the routes that run a generation and so count against `request_limit.max_requests`;
*standby* marks those a standby coordinator still answers (every other predict route answers 503 there). What
each API's fields mean: [Client APIs](../client-apis/index.md).
"""


def api_name(route: Route) -> str:
    module = route.handler.__module__
    if module not in API_OF_MODULE:
        raise KeyError(f"{module} serves {route.method} {route.path}: name its API in docs_gen/routes_reference.py")
    return API_OF_MODULE[module]


def route_rows(routes: RouteTable, counted: bool) -> list[list[str]]:
    rows = []
    for r in routes.routes:
        row = [r.method, f"`{r.path}`", api_name(r), ERROR_BODY[r.error_style]]
        if counted:
            row += [f"`{r.metrics_label}`" if r.metrics_label else "", "yes" if r.generation else "",
                    "yes" if r.on_standby else ""]
        rows.append(row)
    return rows


def render() -> str:
    return "\n".join([
        banner("coordinator/http/routes.py and coordinator/http/management.py"), INTRO,
        "## Predict port (`http_config.predict_ip:predict_port`)\n",
        "The `api` label is the one the request metrics carry.\n",
        table(["method", "path", "API", "error body", "`api` label", "max_requests", "standby"],
              route_rows(PREDICT_ROUTES, counted=True)),
        "## Management port (`http_config.manage_ip:manage_port`)\n",
        table(["method", "path", "API", "error body"], route_rows(MANAGEMENT_ROUTES, counted=False)),
    ])
