"""An ApiError as an HTTP response in the error body of the API the request's path belongs to."""

from __future__ import annotations

from aiohttp import web

from coordinator.apis.openai_common import error_body
from coordinator.apis.tgi_family import error_frame
from coordinator.errors import ApiError
from coordinator.http.route_table import ROUTE_TABLE, ErrorStyle, RouteTable

ERROR_BODIES = {ErrorStyle.OPENAI: error_body, ErrorStyle.TGI: error_frame}


def error_body_at(table: RouteTable, path: str, error: ApiError) -> dict:
    """`error` in the body format of the route at `path`."""
    return ERROR_BODIES[table.error_style(path)](error)


def error_response(request: web.Request, error: ApiError, headers: dict | None = None) -> web.Response:
    """`error` in the body format of the route at the request's path."""
    body = error_body_at(request.app[ROUTE_TABLE], request.path, error)
    return web.json_response(body, status=error.status, headers=headers)
