"""StandbyGate: a standby coordinator refuses client requests, so clients and load balancers move on."""

from __future__ import annotations

from aiohttp import web

from coordinator.cluster.leadership import Leadership
from coordinator.errors import ApiError
from coordinator.http.route_table import ROUTE_TABLE


class StandbyGate:
    """While this coordinator is a standby, every predict-port request but the routes marked `on_standby`
    (health, liveness, metrics) is a 503 with Retry-After: 1, in its API's own error body (the error
    middleware renders the ApiError)."""

    def __init__(self, leadership: Leadership):
        self.leadership = leadership

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        if self.leadership.serving:
            return await handler(request)
        method = "GET" if request.method == "HEAD" else request.method
        route = request.app[ROUTE_TABLE].find(method, request.path)
        if route is not None and route.on_standby:
            return await handler(request)
        leader = self.leadership.leader
        raise ApiError(503, f"this coordinator is a standby (the active one: {leader or 'being elected'}); retry "
                       "through the cluster's address", headers={"Retry-After": "1"})
