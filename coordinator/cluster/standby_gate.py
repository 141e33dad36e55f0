"""StandbyGate: a standby coordinator refuses client requests, so clients and load balancers move on."""

from __future__ import annotations

from coordinator.cluster.leadership import Leadership
from coordinator.errors import ApiError
from coordinator.http.route_table import Route


class StandbyGate:
    """While this coordinator is a standby, every predict-port request but the routes marked `on_standby`
    (health, liveness, metrics) is a 503 with Retry-After: 1, in its API's own error body (RequestGate renders
    the ApiError)."""

    def __init__(self, leadership: Leadership):
        self.leadership = leadership

    def check(self, route: Route | None) -> None:
        """Raise the standby's 503 unless this coordinator serves, or `route` (a HEAD's GET route) is marked
        `on_standby`."""
        if self.leadership.serving or (route is not None and route.on_standby):
            return
        leader = self.leadership.leader
        raise ApiError(503, f"this coordinator is a standby (the active one: {leader or 'being elected'}); retry "
                       "through the cluster's address", headers={"Retry-After": "1"})
