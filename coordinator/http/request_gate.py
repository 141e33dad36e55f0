"""RequestGate: the predict port's one middleware. Every request passes it once, in one frame and with one route
lookup (five nested middlewares cost a frame, a wrapper and a lookup each):

1. the API key (ApiKeyGate): refused first, so a client without one takes no slot and has no body read;
2. for a client API call (a route with a metrics label, or an unrouted POST): the request metrics and the
   request's root span, around everything below;
3. the standby refusal (StandbyGate, on etcd) and the in-flight limit (InFlightLimit, generation routes);
4. the handler, any failure of which leaves as the API's own error body (`failure_response`).

The management port keeps `error_middleware` alone.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from coordinator.cluster.standby_gate import StandbyGate
from coordinator.errors import ApiError
from coordinator.http.auth import ApiKeyGate
from coordinator.http.error_response import error_response
from coordinator.http.route_table import UNROUTED_LABEL, Route, RouteTable
from coordinator.metrics import CoordinatorMetrics
from coordinator.state import STATE

logger = logging.getLogger(__name__)


class InFlightLimit:
    """Counts generation requests in flight; past the limit, new ones get 429 at once."""

    def __init__(self, max_requests: int):
        self.max_requests = max_requests
        self.in_flight = 0

    def refusal(self, request: web.Request) -> web.Response:
        error = ApiError(429, f"too many requests in flight: request_limit.max_requests={self.max_requests}")
        return error_response(request, error, headers={"Retry-After": "1"})


class RequestGate:
    """The predict port's middleware (the module's steps 1-4)."""

    def __init__(self, routes: RouteTable, metrics: CoordinatorMetrics, limit: InFlightLimit,
                 keys: ApiKeyGate | None = None, standby: StandbyGate | None = None):
        self.routes = routes
        self.metrics = metrics
        self.limit = limit
        self.keys = keys
        self.standby = standby

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        if self.keys is not None:
            refused = self.keys.refusal(request)
            if refused is not None:
                return refused
        method = request.method
        if method == "HEAD":  # served by its GET route (aiohttp's add_get), never counted
            route, label = self.routes.find("GET", request.path), None
        else:
            route = self.routes.find(method, request.path)
            label = route.metrics_label if route is not None else (UNROUTED_LABEL if method == "POST" else None)
        if label is None:
            return await self._answer(request, handler, route)
        opened = self.metrics.request_opened(label, request)
        status = 500
        try:
            response = await self._answer(request, handler, route)
            status = response.status
            return response
        except web.HTTPException as exc:  # a redirect the handler raised
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            self.metrics.request_closed(label, opened, status)

    async def _answer(self, request: web.Request, handler, route: Route | None) -> web.StreamResponse:
        try:
            if self.standby is not None:
                self.standby.check(route)
            if route is None or not route.generation:
                return await handler(request)
            limit = self.limit
            if limit.in_flight >= limit.max_requests:
                return limit.refusal(request)
            limit.in_flight += 1
            try:
                return await handler(request)
            finally:
                limit.in_flight -= 1
        except Exception as exc:  # noqa: BLE001 - rendered (or re-raised) by failure_response
            return failure_response(request, exc)


def failure_response(request: web.Request, exc: Exception) -> web.Response:
    """A handler's failure as the API's own error body; nothing escapes as a bare 500 page (a redirect and a
    connection reset are raised again)."""
    if isinstance(exc, ApiError):
        return error_response(request, exc, headers=exc.headers)
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        reason = exc.reason
        if exc.status == 413:
            reason = f"request body exceeds request_limit.body_limit={request.app[STATE].body_limit_mb} MB"
        return error_response(request, ApiError(exc.status, reason), headers={
            k: v for k, v in exc.headers.items() if k.lower() == "allow"
        })
    if isinstance(exc, ConnectionResetError):
        raise exc
    logger.exception("unhandled error on %s %s", request.method, request.path, exc_info=exc)
    return error_response(request, ApiError(500, "internal server error"))


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Every failure leaves as the API's own error body (the management port's middleware)."""
    try:
        return await handler(request)
    except Exception as exc:  # noqa: BLE001 - rendered (or re-raised) by failure_response
        return failure_response(request, exc)
