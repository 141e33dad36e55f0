"""The route reference names each route's API, and refuses a route whose API it cannot name."""

from __future__ import annotations

import pytest

from coordinator.http.route_table import ErrorStyle, Route, RouteTable
from docs_gen.routes_reference import route_rows


async def unnamed_handler(request):
    raise NotImplementedError


def test_a_route_from_a_module_without_an_api_name_fails_generation():
    table = RouteTable([Route("POST", "/v9/new", unnamed_handler, ErrorStyle.OPENAI)])
    with pytest.raises(KeyError, match="tests.docs_gen.test_routes_reference serves POST /v9/new"):
        route_rows(table, counted=False)
