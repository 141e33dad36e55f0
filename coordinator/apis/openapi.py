"""GET /openapi.json: an OpenAPI 3.1 document of the predict port, built from its route table.

Each Route names the pydantic model its body is validated into (`body_model`) and its success
answers (`reply`, an apis.response_models.Reply); its error style names its error body. So a new
route, or a new field on a request model, shows in the document without editing it. The document
is built once per route table, on its first request.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from importlib.metadata import PackageNotFoundError, version

from aiohttp import web
from pydantic import TypeAdapter

from coordinator.apis.response_models import ERROR_BODY_MODELS, OpenApiDocument, Reply
from coordinator.http.auth import API_KEYS
from coordinator.http.route_table import ROUTE_TABLE, ErrorStyle, Route, RouteTable
from coordinator.state import STATE

REF_TEMPLATE = "#/components/schemas/{model}"
# Paths an operator may leave open when API keys are on (auth_config.open_health / open_metrics).
MAYBE_OPEN = frozenset({"/health", "/health/live", "/metrics"})

ERRORS = {
    "400": "The body, or a field of it, is invalid; the message names the field and its range.",
    "401": "A missing or wrong API key (when auth_config.api_keys_file is set).",
    "408": "The body did not arrive within http_config.body_timeout_s.",
    "413": "The body exceeds request_limit.body_limit.",
    "429": "Too many requests in flight (request_limit.max_requests); Retry-After says when to retry.",
    "4XX": "Any other client error (for example 404 for a model not served here, 405 for a wrong method).",
    "500": "An internal error.",
    "503": "No worker could serve the request.",
    "504": "The request timed out.",
}


def error_statuses(route: Route) -> list[str]:
    """The error statuses a route documents: every route's, then those of routes with a body, then generation's."""
    statuses = ["401", "4XX", "500"]
    if route.body_model is not None:
        statuses += ["400", "408", "413"]
    if route.generation:
        statuses += ["429", "503", "504"]
    return sorted(statuses)


def operation_id(route: Route) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "_", route.path).strip("_") or "root"
    return f"{route.method.lower()}_{slug}"


def sse_schema(data: dict, done_marker: str | None) -> dict:
    """One server-sent event whose `data` is JSON (or, last, the done marker)."""
    payload = {"contentMediaType": "application/json", "contentSchema": data}
    if done_marker is not None:
        payload = {"if": {"const": done_marker}, "else": payload}
    return {"type": "object", "required": ["data"], "properties": {"data": {"type": "string", **payload}}}


class _Schemas:
    """Every type the document names, turned into JSON schemas in one pass so they share components."""

    def __init__(self):
        self._types: dict[tuple, object] = {}

    def add(self, key: tuple, t) -> None:
        if t is not None:
            self._types[key] = t

    def build(self) -> tuple[dict[tuple, dict], dict]:
        inputs = [(key, "validation", TypeAdapter(t)) for key, t in self._types.items()]
        by_key, definitions = TypeAdapter.json_schemas(inputs, ref_template=REF_TEMPLATE)
        components = definitions.get("$defs", {})
        _size_bounds_on_unions(components)
        return {key: schema for (key, _), schema in by_key.items()}, components


def _size_bounds_on_unions(node) -> None:
    """pydantic writes `Field(min_length=1)` on `str | list` as a `minLength` beside the `anyOf`, which binds
    strings only; the model counts a list's items too, so the list bound is added (`minItems`)."""
    if isinstance(node, dict):
        if "anyOf" in node:
            for length, items in (("minLength", "minItems"), ("maxLength", "maxItems")):
                if length in node and any(branch.get("type") == "array" for branch in node["anyOf"]):
                    node.setdefault(items, node[length])
        for value in node.values():
            _size_bounds_on_unions(value)
    elif isinstance(node, list):
        for value in node:
            _size_bounds_on_unions(value)


def _success(reply: Reply, schemas: dict, i: int) -> dict:
    content = {}
    if reply.json is not None:
        content["application/json"] = {"schema": schemas[(i, "json")]}
    if reply.events is not None:
        content["text/event-stream"] = {"schema": sse_schema(schemas[(i, "events")], reply.done_marker)}
    if reply.text is not None:
        content[reply.text] = {"schema": {"type": "string"}}
    return content


def success_description(reply: Reply) -> str:
    if reply.description:
        return reply.description
    if reply.events is None:
        return "Success."
    events = "server-sent events, each `data:` one JSON object" + (
        f", then `data: {reply.done_marker}`" if reply.done_marker else "")
    return f"A JSON body; with `stream: true`, {events}." if reply.json is not None else events[0].upper() + events[1:] + "."


def error_response_name(style: ErrorStyle, status: str) -> str:
    return f"{ERROR_BODY_MODELS[style].__name__}{status}"


def _error_responses() -> dict:
    """components.responses: each error status in each style's body."""
    return {error_response_name(style, status): {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": REF_TEMPLATE.format(model=ERROR_BODY_MODELS[style].__name__)}}},
    } for style in ErrorStyle for status, description in ERRORS.items()}


def _operation(i: int, route: Route, schemas: dict, model_name: str, keyed: bool) -> dict:
    doc = inspect.getdoc(route.handler) or inspect.getdoc(inspect.getmodule(route.handler)) or ""
    summary = doc.splitlines()[0] if doc else f"{route.method} {route.path}"
    op: dict = {"operationId": operation_id(route), "summary": summary,
                "tags": [route.handler.__module__.rsplit(".", 1)[-1]]}
    if "\n" in doc:
        op["description"] = doc
    params = re.findall(r"\{([^}]+)\}", route.path)
    if params:
        op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"},
                             **({"description": "the served model", "example": model_name} if p == "model" else {})}
                            for p in params]
    if route.body_model is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schemas[(i, "body")]}}}
    reply = route.reply or Reply()
    responses = {str(status): {"description": success_description(reply) if status < 300 else summary,
                               "content": _success(reply, schemas, i)} for status in reply.statuses}
    for status in error_statuses(route):
        responses.setdefault(status, {"$ref": f"#/components/responses/{error_response_name(route.error_style, status)}"})
    op["responses"] = dict(sorted(responses.items()))
    if keyed:
        op["security"] = [{}, {"apiKey": []}] if route.path in MAYBE_OPEN else [{"apiKey": []}]
    return op


def build_document(table: RouteTable, model_name: str = "", keyed: bool = False) -> dict:
    """The OpenAPI 3.1 document of `table`; `keyed`: API keys are required (auth_config.api_keys_file)."""
    types = _Schemas()
    for style in ErrorStyle:
        types.add(("error", style.value), ERROR_BODY_MODELS[style])
    for i, route in enumerate(table.routes):
        types.add((i, "body"), route.body_model)
        if route.reply is not None:
            types.add((i, "json"), route.reply.json)
            types.add((i, "events"), route.reply.events)
    schemas, components = types.build()
    paths: dict[str, dict] = {}
    for i, route in enumerate(table.routes):
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(i, route, schemas, model_name, keyed)
    try:
        package_version = version("pdserve")
    except PackageNotFoundError:
        package_version = "0"
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdserve", "version": package_version,
                 "description": f"The predict port of a pdserve coordinator serving `{model_name}`: every client "
                                "API, its bodies and its error bodies."},
        "paths": dict(sorted(paths.items())),
        "components": {"schemas": dict(sorted(components.items())),
                       "responses": _error_responses(),
                       "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer",
                                                      "description": "Authorization: Bearer <key>"}}},
    }


@functools.lru_cache(maxsize=8)
def document_bytes(table: RouteTable, model_name: str, keyed: bool) -> bytes:
    return json.dumps(build_document(table, model_name, keyed), ensure_ascii=False).encode("utf-8")


async def openapi(request: web.Request) -> web.Response:
    """This document: every route of the predict port, with its bodies and error bodies (OpenAPI 3.1)."""
    app = request.app
    body = document_bytes(app[ROUTE_TABLE], app[STATE].model_name, app.get(API_KEYS) is not None)
    return web.Response(body=body, content_type="application/json")


ROUTES = [Route("GET", "/openapi.json", openapi, ErrorStyle.TGI, reply=Reply(json=OpenApiDocument))]
