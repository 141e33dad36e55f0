"""An ApiError as an HTTP response in the error body of the API the request's path belongs to."""

from __future__ import annotations

from aiohttp import web

from coordinator.apis.openai_common import error_body
from coordinator.apis.tgi_family import error_frame
from coordinator.errors import OVERLOADED, ApiError
from coordinator.http.route_table import ROUTE_TABLE, ErrorStyle, RouteTable

ERROR_BODIES = {ErrorStyle.OPENAI: error_body, ErrorStyle.TGI: error_frame}


def error_body_at(table: RouteTable, path: str, error: ApiError) -> dict:
    """`error` in the body format of the route at `path`."""
    return ERROR_BODIES[table.error_style(path)](error)


def error_response(request: web.Request, error: ApiError, headers: dict | None = None) -> web.Response:
    """`error` in the body format of the route at the request's path."""
    table = request.app[ROUTE_TABLE]
    body = error_body_at(table, request.path, error)
    status = error.status
    if error.error_type == OVERLOADED and table.error_style(request.path) is ErrorStyle.TGI:
        status = 429  # TGI answers an overloaded queue with 429; OpenAI-style APIs with 503
    return web.json_response(body, status=status, headers=headers)
