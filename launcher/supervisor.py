"""`pdserve up`'s supervisor: child processes started, watched, restarted with backoff, and stopped.

1. `start(children)`: launch them and wait for each one's ready line. Any exit before that is fatal: a first
   start that fails (a bad --model, a taken port, a bad config) would only fail the same way again.
2. `supervise()`: a child that exits is started again with the same command line after a backoff
   (`RestartPolicy`). A start that exits before its ready line (or is not ready within `start_timeout_s`)
   is a failed start; `max_start_failures` of them in a row and the supervisor gives up (`GaveUp`).
3. SIGTERM / SIGINT raise `Stopped` in either phase; `stop_all()` then stops every child, last started first.
4. With `pdserve up --autoscale`: `launch(child)` adds a child while supervising, `retire(child)` stops one for
   good (SIGTERM, not restarted), and `every(seconds, callback)` runs the autoscaler's tick on the main thread.
5. On purpose (the rolling restart, launcher/rolling_restart.py): `restart(child)` sends SIGTERM (the child
   drains) and starts it again at once when it exits: no backoff, no failed start counted, whatever its exit.
   `start_successor(child)` starts the new process before then, while the old one finishes its drain aside
   (`outgoing`; stopped with the rest by `stop_all`). SIGUSR2 calls `signal_handlers[SIGUSR2]`.

The main thread does everything that starts, restarts or stops a child: the parent-death signal the children
get fires when the *thread* that forked them ends. Helper threads only relay a child's output and wait for its
exit, and report both as events on one queue; signal handlers put their signal there too. The main thread
sleeps on that queue until an event or its next timer (a restart that is due, a start taking too long).
"""

from __future__ import annotations

import collections
import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

STOP_GRACE_S = 10.0
TAIL_LINES = 12
PR_SET_PDEATHSIG = 1
# Loaded once here: between fork and exec a child of a threaded parent should not dlopen (loader locks).
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True)


class Stopped(Exception):
    """SIGTERM or SIGINT: stop everything, exit 0."""


class StartFailed(Exception):
    """A child could not start on the first try."""


class GaveUp(Exception):
    """A child failed to start `max_start_failures` times in a row."""


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


@dataclass(frozen=True)
class RestartPolicy:
    """When a child that exited is started again, and when to stop trying."""

    first_backoff_s: float = 0.5  # the first restart waits this long; each one after it twice as long ...
    max_backoff_s: float = 10.0  # ... up to this
    stable_after_s: float = 30.0  # a child up this long since its ready line starts again from first_backoff_s
    max_start_failures: int = 5  # starts in a row that exit before their ready line: give up
    start_timeout_s: float = 180.0  # a start not ready by then is killed; it counts as a failed start


@dataclass
class Backoff:
    """The delay before a child's next restart."""

    policy: RestartPolicy
    next_s: float = 0.0

    def delay(self, uptime_s: float) -> float:
        """The delay for a restart after the child was up `uptime_s` since its ready line (0 if never)."""
        if self.next_s == 0.0 or uptime_s >= self.policy.stable_after_s:
            self.next_s = self.policy.first_backoff_s
        delay = self.next_s
        self.next_s = min(delay * 2, max(self.policy.max_backoff_s, self.policy.first_backoff_s))
        return delay


@dataclass(eq=False)  # identity: the autoscaler keys workers by their Child
class Child:
    """One supervised pdserve process: how to start it, its current process, what it announced, its restarts.

    `on_ready(child)` runs on the main thread after every ready line (e.g. to pin the port it bound, so a
    restart binds the same one)."""

    name: str
    argv: list[str]
    ready_prefix: str
    on_ready: Callable[[Child], None] | None = None
    proc: subprocess.Popen | None = None
    address: str = ""
    announced: dict[str, str] = field(default_factory=dict)  # "pdserve X" -> value, from lines before ready
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    started_at: float = 0.0
    ready_at: float | None = None
    restart_at: float | None = None
    num_restarts: int = 0
    num_failed_starts: int = 0  # in a row
    timed_out: bool = False
    backoff: Backoff | None = None
    retired: bool = False  # stopped on purpose (a scale-down): its exit is not restarted
    restarting: bool = False  # stopped on purpose to start again at once (a rolling restart): not a crash
    planned: bool = False  # its current process was started by a restart on purpose

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def last_output(self) -> str:
        return "".join(f"\n    {line}" for line in self.tail) if self.tail else "\n    (no output)"


def say(message: str) -> None:
    """One line on stderr in one write, so relayed child output cannot land inside it."""
    _relay(sys.stderr, f"pdserve: {message}\n")


def _relay(stream, line: str) -> None:
    try:
        stream.write(line)
        stream.flush()
    except (OSError, ValueError):  # our own output is gone: keep draining the child's pipe anyway
        pass


class Supervisor:
    """Starts, restarts and stops `pdserve up`'s children (the module docstring has its rules)."""

    def __init__(self, policy: RestartPolicy):
        self.policy = policy
        self.children: list[Child] = []
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._supervising = False
        self._tickers: list[list] = []  # [due at, every s, callback]
        self.signal_handlers: dict[int, Callable[[], None]] = {}  # run on the main thread (SIGUSR2)
        self.outgoing: list[tuple[Child, subprocess.Popen]] = []  # replaced processes still draining

    def install_signal_handlers(self) -> None:
        # SimpleQueue.put is reentrant: safe in a handler that interrupts the main thread anywhere.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, lambda signum, _frame: self._events.put(("signal", None, None, signum)))

    def start(self, children: list[Child]) -> None:
        """Launch `children` and wait until each has printed its ready line; raise StartFailed if one exits or
        is not ready within the start timeout."""
        for child in children:
            self.children.append(child)
            child.backoff = Backoff(self.policy)
            self._launch(child)
        deadline = time.monotonic() + self.policy.start_timeout_s
        while (waiting := [c for c in children if c.ready_at is None]):
            if time.monotonic() >= deadline:
                raise StartFailed(f"{waiting[0].name} was not ready after {self.policy.start_timeout_s:g}s; "
                                  f"its last output:{waiting[0].last_output()}")
            self._handle(self._next_event(deadline - time.monotonic()))

    def run_for(self, seconds: float) -> None:
        """Handle events (signals, exits) for `seconds`."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self._handle(self._next_event(left))

    def every(self, seconds: float, callback: Callable[[], None]) -> None:
        """Call `callback()` on the main thread every `seconds` while supervising (the autoscaler's tick)."""
        self._tickers.append([time.monotonic() + seconds, seconds, callback])

    def cancel(self, callback: Callable[[], None]) -> None:
        """Stop calling `callback` (added by `every`)."""
        self._tickers = [ticker for ticker in self._tickers if ticker[2] != callback]  # bound methods: equal, not identical

    def launch(self, child: Child) -> None:
        """Start one more child while supervising, without waiting for its ready line: an exit before it is a
        failed start, restarted with backoff like any other."""
        self.children.append(child)
        child.backoff = Backoff(self.policy)
        self._launch(child)

    def retire(self, child: Child) -> None:
        """SIGTERM to `child` (a worker drains first), which is then not restarted."""
        child.retired = True
        child.restart_at = None
        if child.proc is not None and child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
        elif child in self.children:
            self.children.remove(child)

    def restart(self, child: Child) -> None:
        """SIGTERM to `child`'s running process (a worker or coordinator drains first); when it exits, the child
        is started again at once with the same command line, not counted as a crash."""
        child.restarting = True
        child.proc.send_signal(signal.SIGTERM)

    def start_successor(self, child: Child) -> bool:
        """Start `child` again now, while the process `restart` stopped finishes its drain aside; False if that
        one has exited already (and was started again)."""
        if not child.restarting:
            return False
        old = child.proc
        self._launch(child, planned=True)  # an OSError leaves it restarting: started again when the old one exits
        child.restarting = False
        self.outgoing.append((child, old))
        return True

    def supervise(self) -> None:
        """Restart children that exit until SIGTERM/SIGINT (Stopped) or a child keeps failing to start (GaveUp)."""
        self._supervising = True
        while True:
            self._run_timers()
            self._handle(self._next_event(self._next_timer() - time.monotonic()))

    def stop_all(self) -> None:
        """SIGTERM to every running child, last started first (the coordinator before the workers, so no new
        work reaches a worker about to go); SIGKILL to any still running after STOP_GRACE_S."""
        self._supervising = False
        running = [c.proc for c in reversed(self.children) if c.proc is not None and c.proc.poll() is None]
        running += [proc for _, proc in self.outgoing if proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _launch(self, child: Child, planned: bool = False) -> None:
        parent = os.getpid()

        def die_with_parent() -> None:
            _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the launcher died before prctl: nothing would stop this child
                os._exit(1)

        proc = subprocess.Popen(child.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                errors="replace", preexec_fn=die_with_parent)
        child.proc, child.started_at, child.ready_at, child.restart_at, child.timed_out, child.planned = (
            proc, time.monotonic(), None, None, False, planned)
        child.tail = collections.deque(maxlen=TAIL_LINES)
        readers = [threading.Thread(target=self._read_stdout, args=(child, proc, child.tail), daemon=True),
                   threading.Thread(target=self._read_stderr, args=(proc, child.tail), daemon=True)]
        for reader in readers:
            reader.start()
        threading.Thread(target=self._wait_exit, args=(child, proc, readers), daemon=True).start()

    def _read_stdout(self, child: Child, proc: subprocess.Popen, tail: collections.deque) -> None:
        announced: dict[str, str] = {}
        ready = False
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            if not ready and line.startswith(child.ready_prefix):
                ready = True
                address = line.strip().rsplit(" ", 1)[-1].split("=", 1)[-1]
                self._events.put(("ready", child, proc, (address, announced)))
                continue
            key, sep, value = line.partition(": ")
            if not ready and sep and key.startswith("pdserve "):  # e.g. "pdserve coordinator management: URL"
                announced[key] = value.strip()
            _relay(sys.stdout, line)

    @staticmethod
    def _read_stderr(proc: subprocess.Popen, tail: collections.deque) -> None:
        for line in proc.stderr:
            tail.append(line.rstrip("\n"))
            _relay(sys.stderr, line)

    def _wait_exit(self, child: Child, proc: subprocess.Popen, readers: list[threading.Thread]) -> None:
        code = proc.wait()
        for reader in readers:
            reader.join(timeout=1.0)  # its last lines belong in the exit message
        self._events.put(("exit", child, proc, code))

    def _next_event(self, timeout: float):
        try:
            return self._events.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None

    def _next_timer(self) -> float:
        timers = [c.restart_at for c in self.children if c.restart_at is not None]
        timers += [c.started_at + self.policy.start_timeout_s for c in self.children
                   if c.ready_at is None and c.restart_at is None and not c.timed_out]
        timers += [ticker[0] for ticker in self._tickers]
        return min(timers, default=time.monotonic() + 3600.0)

    def _run_timers(self) -> None:
        now = time.monotonic()
        for ticker in self._tickers:
            if ticker[0] <= now:
                ticker[2]()
                ticker[0] = time.monotonic() + ticker[1]
        for child in self.children:
            if child.restart_at is not None and child.restart_at <= now:
                try:
                    self._launch(child)
                except OSError as exc:  # fork or exec failed: a failed start like any other
                    child.ready_at = None
                    self._restart_later(child, f"could not be started ({exc})")
            elif (child.ready_at is None and child.restart_at is None and not child.timed_out
                  and child.started_at + self.policy.start_timeout_s <= now):
                child.timed_out = True
                child.proc.kill()  # its exit event counts the failed start

    def _handle(self, event) -> None:
        if event is None:
            return
        kind, child, proc, value = event
        if kind == "signal":
            self._on_signal(value)
        elif proc is not child.proc or (kind == "ready" and child.timed_out):
            # From a process already replaced (one that drained aside is forgotten once it exits), or ready only
            # after it was killed for being late.
            if kind == "exit" and (child, proc) in self.outgoing:
                self.outgoing.remove((child, proc))
        elif kind == "ready":
            child.address, child.announced = value
            child.ready_at = time.monotonic()
            child.num_failed_starts = 0
            if child.on_ready is not None:
                child.on_ready(child)
            if child.num_restarts and not child.planned:
                say(f"{child.name} is back at {child.address} (pid {proc.pid}, restarts {child.num_restarts})")
        elif kind == "exit":
            self._on_exit(child, value)

    def _on_signal(self, signum: int) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT):
            raise Stopped
        if signum == signal.SIGHUP:  # reload the whole cluster's certificates, keys and secrets
            for proc in [c.proc for c in self.children] + [proc for _, proc in self.outgoing]:
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGHUP)
        elif signum == signal.SIGUSR1:
            self.print_status()
        elif signum in self.signal_handlers:
            self.signal_handlers[signum]()
        else:
            say(f"{signal.Signals(signum).name} ignored: nothing to do for it yet")

    def print_status(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.restart_at is not None:
                state = f"restarting in {max(0.0, child.restart_at - now):.1f}s"
            elif child.ready_at is None:
                state = f"starting (pid {child.proc.pid})"
            else:
                state = f"up {now - child.ready_at:.0f}s at {child.address} (pid {child.proc.pid})"
            say(f"status: {child.name}: {state}, restarts {child.num_restarts}")
        for child, proc in self.outgoing:
            say(f"status: {child.name}: its previous process (pid {proc.pid}) finishes its running requests")

    def _on_exit(self, child: Child, code: int) -> None:
        if child.retired:
            self.children.remove(child)
            say(f"{child.name} stopped ({describe_exit(code)})")
            return
        if child.restarting:  # stopped on purpose: started again at once, however it exited
            child.restarting = False
            try:
                self._launch(child, planned=True)
            except OSError as exc:  # fork or exec failed: a failed start like any other
                child.ready_at = None
                self._restart_later(child, f"could not be started ({exc})")
            return
        if child.timed_out:
            what = f"was not ready after {self.policy.start_timeout_s:g}s"
        else:
            what = describe_exit(code) + (" before it was ready" if child.ready_at is None else "")
        if not self._supervising:
            raise StartFailed(f"{child.name} {what}; its last output:{child.last_output()}")
        self._restart_later(child, what, f"(pid {child.proc.pid}{', ' + child.address if child.address else ''}) ")

    def _restart_later(self, child: Child, what: str, which: str = "") -> None:
        """Schedule the next start of `child`, which just exited (or could not be started) as `what` says;
        `which` names the process in the log line."""
        uptime_s = 0.0
        if child.ready_at is None:
            child.num_failed_starts += 1
            if child.num_failed_starts >= self.policy.max_start_failures:
                raise GaveUp(f"{child.name} failed to start {child.num_failed_starts} times in a row (last: {what}); "
                             f"its last output:{child.last_output()}")
        else:
            uptime_s = time.monotonic() - child.ready_at
        delay = child.backoff.delay(uptime_s)
        child.num_restarts += 1
        child.restart_at = time.monotonic() + delay
        say(f"{child.name} {which}{what}; restart {child.num_restarts} in {delay:g}s")
