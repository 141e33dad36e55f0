"""Test processes forked from one that has imported pdserve already: a worker or coordinator ready without paying
Python's imports of torch, transformers, grpc and aiohttp again (about three CPU seconds of each start here, and
the suite starts a few hundred).

Life cycle of a forked process:
  1. The first `pdserve worker` / `pdserve coordinator` a test process starts brings up its fork server
     (`python -m tests.fork_server`, a real subprocess): it imports what those commands import, binds a Unix
     socket, and waits, starting no threads of its own (torch's import leaves two) and loading no native library
     the commands load later: the engine's kernels and their OpenMP runtime load in each child, as in a spawned
     worker. Environment that modules read when imported (PDSERVE_KERNEL_MARCH, OMP_*) is the server's, which is
     the test process's.
  2. A start sends argv, environment and working folder over a connection of its own, with the write end of the
     pipe its output goes to (SCM_RIGHTS). The server forks; the child resets its signals, takes that pipe as
     stdout and stderr, the environment and folder, and runs `launcher.cli.main` as `python -m launcher.cli`
     would, exiting with its code. The server answers the child's pid.
  3. The test signals the child by pid as any process (SIGSTOP, SIGKILL...); when it exits, the server reaps it
     and writes its exit code (negative: the signal) on that connection: `ForkedProcess.wait` reads it.
  4. The server exits when its test process does (its stdin closes), and each child with it (PR_SET_PDEATHSIG).

What the commands' own start-up does (imports, a coordinator that never loads torch) is tested on processes
started by `python -m launcher.cli` as before (`ServerProcess(..., fork=False)`, `pdserve up`'s children).
`PDSERVE_TEST_FORK=0` starts every process that way.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

ENABLED = os.environ.get("PDSERVE_TEST_FORK", "1") != "0"
COMMANDS = ("worker", "coordinator")  # the subcommands a fork serves; anything else is spawned
PR_SET_PDEATHSIG = 1


def forkable(argv: list[str]) -> bool:
    """A `python -m launcher.cli worker|coordinator ...` command line, which a fork runs as its own process."""
    return ENABLED and argv[:3] == [sys.executable, "-m", "launcher.cli"] and len(argv) > 3 and argv[3] in COMMANDS


class ForkedProcess:
    """A forked child with the part of subprocess.Popen's interface tests use: pid, poll, wait, signals, stdout."""

    def __init__(self, argv: list[str], connection: socket.socket, stdout):
        self.args = argv
        self.stdout = stdout
        self.returncode: int | None = None
        self._connection = connection
        reply = connection.makefile("r")
        self.pid = int(reply.readline())
        self._exited = threading.Event()

        def await_exit():
            line = reply.readline()
            self.returncode = int(line) if line else -signal.SIGKILL  # the server gone: its children died with it
            connection.close()
            self._exited.set()

        threading.Thread(target=await_exit, daemon=True).start()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # exited; its code is on its way

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkClient:
    """This test process's fork server, started on first use."""

    _lock = threading.Lock()
    _server: subprocess.Popen | None = None
    _socket_path: str | None = None

    @classmethod
    def start(cls, argv: list[str], env: dict, cwd: Path) -> ForkedProcess:
        path = cls._ensure_server()
        read_end, write_end = os.pipe()
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(path)
        request = json.dumps({"argv": argv, "env": env, "cwd": str(cwd)}).encode() + b"\n"
        socket.send_fds(connection, [request], [write_end])
        os.close(write_end)
        return ForkedProcess(argv, connection, os.fdopen(read_end, "r", errors="replace"))

    @classmethod
    def _ensure_server(cls) -> str:
        with cls._lock:
            if cls._server is None or cls._server.poll() is not None:
                folder = tempfile.mkdtemp(prefix="pdserve-fork-")
                cls._socket_path = os.path.join(folder, "server.sock")
                cls._server = subprocess.Popen([sys.executable, "-m", "tests.fork_server", cls._socket_path],
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                               cwd=Path(__file__).resolve().parents[1])
                if cls._server.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"the fork server did not start (exit {cls._server.wait()})")
                atexit.register(cls._server.kill)
            return cls._socket_path


def preload() -> None:
    """What `pdserve worker` and `pdserve coordinator` import, imported once here (no threads started)."""
    import launcher.cli  # noqa: F401
    import worker.service.serve  # noqa: F401
    import worker.torch_engine.build  # noqa: F401  (torch, transformers' models, the engines)
    import coordinator.http.server  # noqa: F401


def run_child(request: dict, out_fd: int) -> None:
    """In the forked child: become the command, then exit with its code (never return into the server)."""
    code = 1
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a Python process starts
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # Python's own default: a closed pipe raises, not kills
        signal.set_wakeup_fd(-1)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        null = os.open(os.devnull, os.O_RDONLY)  # not the server's stdin: the test process's end of it
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["launcher.cli", *request["argv"][3:]]
        from launcher.cli import main

        code = main(request["argv"][3:])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001  (the child's own failure, reported as a process would)
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def serve(socket_path: str) -> None:
    """The server's loop: accept starts, fork them, report exits; until the test process's end closes stdin."""
    preload()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path)
    server.listen(64)
    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_write, False)
    signal.set_wakeup_fd(wakeup_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD wakes the loop
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ, "accept")
    selector.register(wakeup_read, selectors.EVENT_READ, "child")
    selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.data == "stdin":
                if not sys.stdin.readline():
                    return  # the test process is gone: its children die with this one
            elif key.data == "accept":
                connection, _ = server.accept()
                try:
                    request, out_fd = read_request(connection)
                except (OSError, ValueError):
                    connection.close()  # a start that never arrived whole: the other children go on
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    for own in (server, connection, *children.values()):
                        own.close()
                    os.close(wakeup_read)
                    os.close(wakeup_write)
                    run_child(request, out_fd)
                os.close(out_fd)
                try:
                    connection.sendall(f"{pid}\n".encode())
                except OSError:
                    pass  # its test process stopped listening; the child is reaped all the same
                children[pid] = connection
            else:
                os.read(wakeup_read, 4096)
                reap(children)


def read_request(connection: socket.socket) -> tuple[dict, int]:
    """One start: a JSON line, with the output pipe's write end alongside its first bytes."""
    message, fds, _, _ = socket.recv_fds(connection, 1 << 16, 1)
    if len(fds) != 1:
        raise ValueError("a start without its output pipe")
    while not message.endswith(b"\n"):
        more = connection.recv(1 << 16)
        if not more:
            os.close(fds[0])
            raise ValueError("a start cut short")
        message += more
    return json.loads(message), fds[0]


def reap(children: dict[int, socket.socket]) -> None:
    """Every exited child's code to its connection."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            try:
                connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass  # its test process stopped listening
            connection.close()


if __name__ == "__main__":
    serve(sys.argv[1])
