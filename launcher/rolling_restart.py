"""`pdserve up`'s rolling restart (SIGUSR2): every process of the cluster replaced by a new one, one at a time,
through the drains an operator's upgrade uses, so that no request is lost.

1. The workers, one at a time; those alone in their role last. Each waits until it is up and, unless it is alone
   in its role, until another worker of its role is healthy in the coordinator (GET /v1/instances). Then SIGTERM:
   the worker reports `draining` (no new requests reach it), deregisters if registered, finishes its prefills and
   KV sends, lets its decode streams run to their end within its --drain-seconds and exits; streams still running
   then move to another decode worker (the coordinator's migration: one unbroken stream for the client). Once it
   has exited by itself it is started again at once on the same gRPC port (not a crash: no backoff), and the next
   worker waits until the coordinator, having taken this one out of routing, lists it healthy again (a verdict of
   its health checks on the new process, not what it still believed of the old one).
   A worker alone in its role is restarted all the same, last, with a warning: until it is back, requests that
   need its role fail with 503 (clients retry).
2. The coordinator: SIGTERM. It stops accepting at once and gives running requests its drain_seconds. As soon as
   its predict and management ports are closed, the new coordinator starts on the same ports while the old one
   finishes aside; connections are refused only for the new one's start-up (clients retry them: no request was
   taken). Done when the new one is ready and lists every worker healthy (its config's workers by its health
   checks, --autoscale workers as they re-register), and the old one has exited.

Each step is one line on stderr ("rolling restart: decode worker 0 draining (pid N)", "... back at ...",
"rolling restart: done ..."); a step not done in time stops the rolling restart with a line saying which (the
supervisor goes on as ever). A second SIGUSR2 while one runs is ignored with a line. Everything runs on the
supervisor's main thread, on a ticker while a rolling restart runs.
"""

from __future__ import annotations

import json
import socket
import ssl
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

from launcher.supervisor import Child, Supervisor, describe_exit, say

TICK_S = 0.2
DEFAULT_DRAIN_S = 30.0  # a worker's --drain-seconds, the coordinator's http_config.drain_seconds
EXIT_GRACE_S = 60.0  # past its drain time, how long a process may take to exit before the restart stops
READY_TIMEOUT_S = 300.0  # a process ready, a peer or the worker healthy in the coordinator
ROLES = ("prefill", "decode")


@dataclass
class Wait:
    """One step's condition, checked every tick until it holds or `timeout_s` passes."""

    what: str
    done: Callable[[], bool]
    timeout_s: float = READY_TIMEOUT_S
    since: float = 0.0


def role_of(child: Child) -> str:
    """A worker's role: its --role flag (an autoscaled worker switched in place has it updated), else its name's."""
    if "--role" in child.argv:
        return child.argv[child.argv.index("--role") + 1]
    return next((role for role in ROLES if child.name.startswith(role)), "")


def drain_seconds(child: Child) -> float:
    """A worker's --drain-seconds (its last one on the command line), else the default."""
    flags = [i for i, arg in enumerate(child.argv[:-1]) if arg == "--drain-seconds"]
    return float(child.argv[flags[-1] + 1]) if flags else DEFAULT_DRAIN_S


def worker_order(workers: list[Child]) -> tuple[list[Child], list[Child]]:
    """The workers in the order they are restarted (those with a peer of their role first), and those alone."""
    alone = [c for c in workers if sum(role_of(other) == role_of(c) for other in workers) == 1]
    return [c for c in workers if c not in alone] + alone, alone


def port_closed(url: str) -> bool:
    """Nothing listens on `url`'s host and port any more (a listener keeps it from being bound, even with
    SO_REUSEADDR; connections still open on it do not)."""
    parts = urlsplit(url)
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((parts.hostname, parts.port))
        except OSError:
            return False
    return True


class RollingRestart:
    """SIGUSR2's rolling restart of `pdserve up`'s cluster (the module docstring has its steps)."""

    def __init__(self, supervisor: Supervisor, coordinator: Child, management_key: str, token: str,
                 ssl_context: ssl.SSLContext | None, coordinator_drain_s: float,
                 busy: Callable[[], str] = lambda: ""):
        """`management_key`: the coordinator's announced line naming its management URL; `busy()`: why a rolling
        restart cannot begin now ("" when it can: the autoscaler's actions under way)."""
        self.supervisor = supervisor
        self.coordinator = coordinator
        self.management_key = management_key
        self.headers = {"Authorization": f"Bearer {token}"}
        self.ssl_context = ssl_context
        self.coordinator_drain_s = coordinator_drain_s
        self.busy = busy
        self.steps: Iterator[Wait] | None = None
        self.waiting: Wait | None = None
        self.began = 0.0

    @property
    def running(self) -> bool:
        return self.steps is not None

    def begin(self) -> None:
        """SIGUSR2: start a rolling restart, unless one runs (or the autoscaler acts)."""
        if self.running:
            say(f"rolling restart: already under way ({self.waiting.what if self.waiting else 'starting'}); "
                "SIGUSR2 ignored")
            return
        reason = self.busy()
        if reason:
            say(f"rolling restart: not now: {reason}; send SIGUSR2 again later")
            return
        workers = [c for c in self.supervisor.children if c is not self.coordinator and not c.retired]
        order, alone = worker_order(workers)
        say(f"rolling restart: {len(order)} workers one at a time, then the coordinator")
        for child in alone:
            say(f"rolling restart: warning: {child.name} is the only {role_of(child)} worker: it goes last, and "
                f"requests that need a {role_of(child)} worker fail (503) until it is back")
        self.began = time.monotonic()
        self.steps = self._plan(order)
        self.waiting = None
        self.supervisor.every(TICK_S, self.tick)
        self.tick()

    def tick(self) -> None:
        """Advance through every step whose condition holds; stop the rolling restart on one overdue."""
        try:
            while self.waiting is None or self.waiting.done():
                self.waiting = next(self.steps)
                self.waiting.since = time.monotonic()
        except StopIteration:
            self._end()
            return
        except Exception as exc:  # noqa: BLE001 - a bug here must not take the supervisor down with it
            say(f"rolling restart: stopped: {type(exc).__name__}: {exc}")
            self._end()
            return
        if time.monotonic() - self.waiting.since > self.waiting.timeout_s:
            say(f"rolling restart: stopped: {self.waiting.what} took over {self.waiting.timeout_s:g}s; the "
                "processes not restarted yet keep running (send SIGUSR2 again to start over)")
            self._end()

    def _end(self) -> None:
        self.supervisor.cancel(self.tick)
        self.steps = self.waiting = None

    def _plan(self, workers: list[Child]) -> Iterator[Wait]:
        for child in workers:
            yield from self._restart_worker(child, workers)
        yield from self._restart_coordinator(workers)
        say(f"rolling restart: done: {len(workers) + 1} processes restarted in "
            f"{time.monotonic() - self.began:.0f}s")

    def _restart_worker(self, child: Child, workers: list[Child]) -> Iterator[Wait]:
        role = role_of(child)
        peers = [c for c in workers if c is not child and role_of(c) == role]
        yield Wait(f"{child.name} up", lambda: self._up(child))
        if peers:
            yield Wait(f"another {role} worker healthy in the coordinator",
                       lambda: any(self._up(peer) and self._healthy(peer) is True for peer in peers))
        old = child.proc
        say(f"rolling restart: {child.name} draining (pid {old.pid}, {child.address})")
        self.supervisor.restart(child)
        # Seen out (draining, gone or deregistered) before it is seen healthy again: then that verdict is the
        # coordinator's health check of the new process, not what it still believed of the old one.
        yield Wait(f"the coordinator to take {child.name} out of routing", lambda: self._healthy(child) is False)
        yield Wait(f"{child.name} (pid {old.pid}) to exit", lambda: old.returncode is not None,
                   drain_seconds(child) + EXIT_GRACE_S)
        say(f"rolling restart: {child.name} (pid {old.pid}) exited by itself: {describe_exit(old.returncode)}; "
            f"starting it again at {child.address}")
        yield Wait(f"{child.name} ready again", lambda: child.proc is not old and self._up(child))
        yield Wait(f"{child.name} healthy in the coordinator", lambda: self._healthy(child) is True)
        say(f"rolling restart: {child.name} back at {child.address} (pid {child.proc.pid})")

    def _restart_coordinator(self, workers: list[Child]) -> Iterator[Wait]:
        coordinator = self.coordinator
        yield Wait("the coordinator up", lambda: self._up(coordinator))
        old, predict, management = coordinator.proc, coordinator.address, self._management_url()
        say(f"rolling restart: coordinator draining (pid {old.pid}): it takes no new connections and finishes "
            "its running requests")
        self.supervisor.restart(coordinator)
        yield Wait(f"the coordinator (pid {old.pid}) to close {predict} and {management}",
                   lambda: old.returncode is not None or (port_closed(management) and port_closed(predict)),
                   self.coordinator_drain_s + EXIT_GRACE_S)
        handed_over = self.supervisor.start_successor(coordinator)
        if handed_over:
            say(f"rolling restart: a new coordinator starts on the same ports while the old one (pid {old.pid}) "
                "finishes its requests; connections are refused until it is ready")
        else:
            say(f"rolling restart: coordinator (pid {old.pid}) exited by itself: {describe_exit(old.returncode)}; "
                "starting it again")
        yield Wait("the new coordinator ready", lambda: coordinator.proc is not old and self._up(coordinator))
        say(f"rolling restart: coordinator back at {coordinator.address} (pid {coordinator.proc.pid})")
        yield Wait("the new coordinator to list every worker healthy",
                   lambda: self._healthy(*(child for child in workers if self._up(child))) is True)
        if handed_over:
            yield Wait(f"the old coordinator (pid {old.pid}) to exit", lambda: old.returncode is not None,
                       self.coordinator_drain_s + EXIT_GRACE_S)
            say(f"rolling restart: the old coordinator (pid {old.pid}) exited by itself: "
                f"{describe_exit(old.returncode)}")

    @staticmethod
    def _up(child: Child) -> bool:
        return child.ready_at is not None and child.proc is not None and child.proc.returncode is None

    def _management_url(self) -> str:
        return self.coordinator.announced[self.management_key].rstrip("/")

    def _healthy(self, *workers: Child) -> bool | None:
        """Whether the coordinator lists every one of `workers` healthy (routable) in its role; None when it
        cannot be asked (restarting: the next tick asks again)."""
        try:
            request = urllib.request.Request(self._management_url() + "/v1/instances", headers=self.headers)
            with urllib.request.urlopen(request, timeout=2, context=self.ssl_context) as response:
                listed = json.loads(response.read())
        except (OSError, ValueError, KeyError):
            return None
        healthy = {(role, i.get("address")) for role, group in listed.items() if isinstance(group, list)
                   for i in group if i.get("state") == "healthy"}
        return all((role_of(child), child.address) in healthy for child in workers)
