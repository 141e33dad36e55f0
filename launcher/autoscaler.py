"""`pdserve up --autoscale`: the local connector, acting on the coordinator's online planner (`GET /v1/plan`).

Every tick, once the last actions are done, one kind of action moves the workers toward the desired counts:
  1. One role over and the other under: switch workers of the first in place (`POST /v1/instances/switch_role`;
     the model stays loaded), the least busy first, as many as both differences allow.
  2. Both under (or one under, the other right): start the workers short, up to --max-workers.
  3. One role over, the other not under: stop its least busy worker (SIGTERM: it deregisters and drains first),
     one at a time.
Encode workers (`--encoders`, the planner's `encode` count) are started and stopped, never switched: their model
part is another. Never below one worker of a role. An action is done when the coordinator lists the worker in its
new role (a start or a switch) or its process has exited (a stop); one not done within ACTION_TIMEOUT_S is given
up.
"""

from __future__ import annotations

import json
import logging
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from launcher.supervisor import Child, Supervisor
from worker.service.options import ALL_ROLES as SCALED_ROLES, ROLES

logger = logging.getLogger(__name__)

ACTION_TIMEOUT_S = 180.0
SWITCH_DRAIN_S = 30.0  # a switched worker's longest drain; decode streams left then migrate


@dataclass
class Action:
    kind: str  # start, switch or stop
    child: Child
    role: str  # the role it ends in
    started: float


def _role_flag(argv: list[str], role: str) -> list[str]:
    i = argv.index("--role")
    return argv[:i + 1] + [role] + argv[i + 2:]


def next_actions(desired: dict, workers: dict[Child, str], listed: dict, max_workers: int) -> list[tuple]:
    """The actions of one tick (the module docstring's rules): (kind, child or None, role), where role is the role
    a switched or started worker ends in, or the one a stopped worker leaves. `listed`: role -> address -> the
    coordinator's entry (GET /v1/instances)."""
    roles = [role for role in SCALED_ROLES if role in desired]
    by_role = {role: [c for c, r in workers.items() if r == role and c.ready_at is not None
                      and c.address in listed.get(role, {})] for role in roles}
    have = {role: sum(1 for r in workers.values() if r == role) for role in roles}
    short = {role: desired[role] - have[role] for role in roles}
    over = [role for role in roles if short[role] < 0 and have[role] > 1]
    under = [role for role in roles if short[role] > 0]

    def least_busy(role: str) -> list[Child]:
        return sorted(by_role[role], key=lambda c: listed[role][c.address].get("outstanding_requests", 0))

    switch_over, switch_under = [r for r in over if r in ROLES], [r for r in under if r in ROLES]
    if switch_over and switch_under and by_role[switch_over[0]]:
        source, target = switch_over[0], switch_under[0]
        count = min(-short[source], short[target], have[source] - 1)
        return [("switch", child, target) for child in least_busy(source)[:count]]
    if under and len(workers) < max_workers:
        room, actions = max_workers - len(workers), []
        for role in sorted(under, key=lambda r: -short[r]):
            take = min(short[role], room - len(actions))
            actions += [("start", None, role)] * take
        return actions
    if over and by_role[over[0]]:
        return [("stop", least_busy(over[0])[0], over[0])]
    return []


class LocalAutoscaler:
    """Starts, stops and switches `pdserve up`'s workers under its supervisor, as the planner asks."""

    def __init__(self, supervisor: Supervisor, management_url: str, token: str, ssl_context: ssl.SSLContext | None,
                 new_worker: Callable[[str], Child], workers: dict[Child, str], max_workers: int,
                 say: Callable[[str], None]):
        self.supervisor = supervisor
        self.url = management_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self.ssl_context = ssl_context
        self.new_worker = new_worker
        self.workers = workers  # child -> its role now
        self.max_workers = max_workers
        self.say = say
        self.pending: list[Action] = []

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        request = urllib.request.Request(self.url + path, method=method, headers=self.headers,
                                         data=None if body is None else json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=5, context=self.ssl_context) as response:
            return json.loads(response.read() or b"{}")

    def tick(self) -> None:
        """One look at the plan and the instances; at most one action."""
        try:
            plan = self._call("GET", "/v1/plan")
            instances = self._call("GET", "/v1/instances")
        except (OSError, ValueError) as exc:  # the coordinator restarting: the next tick tries again
            logger.warning("autoscale: cannot read the plan: %s", exc)
            return
        listed = {role: {i["address"]: i for i in instances.get(role, [])} for role in SCALED_ROLES}
        self.pending = [action for action in self.pending if not self._done(action, listed)]
        if self.pending:
            return
        desired = plan.get("desired")
        if not desired:
            return
        self._act(desired, listed)

    def _done(self, action: Action, listed: dict) -> bool:
        child = action.child
        if action.kind == "stop":
            done = child not in self.supervisor.children
        else:
            done = child.ready_at is not None and child.address in listed[action.role]
        if not done and time.monotonic() - action.started > ACTION_TIMEOUT_S:
            self.say(f"autoscale: gave up waiting for {action.kind} of {child.name}")
            return True
        return done

    def _act(self, desired: dict, listed: dict) -> None:
        for kind, child, role in next_actions(desired, self.workers, listed, self.max_workers):
            if kind == "switch":
                self._switch(child, self.workers[child], role)
            elif kind == "start":
                self._start(role)
            else:
                self._stop(child, role)

    def _switch(self, child: Child, old: str, new: str) -> None:
        try:
            self._call("POST", "/v1/instances/switch_role",
                       {"address": child.address, "role": new, "drain_timeout_s": SWITCH_DRAIN_S})
        except urllib.error.HTTPError as exc:
            self.say(f"autoscale: switching {child.name} to {new} refused: {exc.code} {exc.read()[:300]!r}")
            return
        except OSError as exc:
            self.say(f"autoscale: switching {child.name} to {new} failed: {exc}")
            return
        child.argv = _role_flag(child.argv, new)  # a restart comes back in the new role
        old_name, child.name = child.name, child.name.replace(old, new, 1)
        self.workers[child] = new
        self._begin("switch", child, new, f"{old_name} ({child.address}) switches to {new} in place")

    def _start(self, role: str) -> None:
        child = self.new_worker(role)
        self.workers[child] = role
        self.supervisor.launch(child)
        self._begin("start", child, role, f"starting {child.name}")

    def _stop(self, child: Child, role: str) -> None:
        del self.workers[child]
        self.supervisor.retire(child)
        self._begin("stop", child, role, f"stopping {child.name} ({child.address}): it drains first")

    def _begin(self, kind: str, child: Child, role: str, what: str) -> None:
        self.pending.append(Action(kind, child, role, time.monotonic()))
        counts = {r: sum(1 for x in self.workers.values() if x == r) for r in SCALED_ROLES}
        encoders = f" + {counts['encode']} encode" if counts["encode"] else ""
        self.say(f"autoscale: {what} (workers: {counts['prefill']} prefill + {counts['decode']} decode{encoders})")
