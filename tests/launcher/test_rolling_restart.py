"""`pdserve up`'s rolling restart (SIGUSR2): every process replaced one at a time while clients stream, and no
request fails or changes; its rules without a cluster; the supervisor's restarts on purpose with tiny processes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import threading
import time

import httpx
import pytest

from launcher.rolling_restart import drain_seconds, port_closed, role_of, worker_order
from launcher.supervisor import Child, RestartPolicy, Supervisor
from tests.helpers import (GREEDY_PROMPTS, ServerProcess, alive, cmdline, descendants, free_port, pdserve_argv,
                           registration_headers, sse_events, wait_for)

# A child that prints its ready line and exits 0 at its first SIGTERM; or, the first one to create the file
# sys.argv[1] names, at its second (a drain that lasts until it is told to stop).
FAKE = ("import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM]); "
        "drain = sys.argv[1:] and not os.path.exists(sys.argv[1]) and open(sys.argv[1], 'w'); "
        "print('fake ready: 127.0.0.1:1', flush=True); signal.sigwait([signal.SIGTERM]); "
        "drain and signal.sigwait([signal.SIGTERM])")


def fake_child(drain_marker=None) -> Child:
    return Child("fake worker", [sys.executable, "-c", FAKE, *([str(drain_marker)] if drain_marker else [])],
                 "fake ready:")


def run_until(supervisor: Supervisor, predicate, timeout_s: float = 30.0) -> None:
    """Handle the supervisor's events until `predicate()` holds (the supervisor's own loop, as `pdserve up` runs)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        supervisor.run_for(0.05)


@pytest.mark.system  # tiny processes
def test_a_restart_on_purpose_starts_the_child_again_at_once_and_counts_no_crash():
    supervisor = Supervisor(RestartPolicy(first_backoff_s=60.0, max_start_failures=1))  # a crash would wait 60 s
    child = fake_child()
    supervisor.start([child])
    try:
        old = child.proc
        supervisor.restart(child)
        run_until(supervisor, lambda: child.proc is not old and child.ready_at is not None)
        assert old.returncode == 0
        assert (child.num_restarts, child.num_failed_starts, child.restart_at, child.planned) == (0, 0, None, True)
    finally:
        supervisor.stop_all()


def restarting_a_draining_child(tmp_path) -> tuple[Supervisor, Child, object]:
    """A child that drains until SIGTERMed again, started and restarted on purpose: (supervisor, child, old proc)."""
    supervisor = Supervisor(RestartPolicy(first_backoff_s=60.0, max_start_failures=1))
    child = fake_child(drain_marker=tmp_path / "drained")
    supervisor.start([child])
    old = child.proc
    supervisor.restart(child)
    return supervisor, child, old


@pytest.mark.system  # tiny processes
def test_a_successor_starts_while_the_old_process_drains_aside_whose_exit_is_then_forgotten(tmp_path):
    supervisor, child, old = restarting_a_draining_child(tmp_path)
    try:
        assert supervisor.start_successor(child)
        assert not supervisor.start_successor(child)  # one successor
        run_until(supervisor, lambda: child.ready_at is not None)
        assert child.proc is not old and old.poll() is None and supervisor.outgoing == [(child, old)]
        old.send_signal(signal.SIGTERM)  # its drain ends
        run_until(supervisor, lambda: not supervisor.outgoing)  # its exit is heard, and not taken for the child's
        assert old.returncode == 0 and child.proc.poll() is None and child.num_restarts == 0
    finally:
        supervisor.stop_all()


@pytest.mark.system  # tiny processes
def test_stop_all_stops_an_old_process_still_draining_aside(tmp_path):
    supervisor, child, old = restarting_a_draining_child(tmp_path)
    try:
        supervisor.start_successor(child)
        run_until(supervisor, lambda: child.ready_at is not None)
    finally:
        supervisor.stop_all()
    assert old.returncode == 0 and child.proc.returncode == 0  # the old one's drain ended by stop_all's SIGTERM


def worker(name: str, *flags: str) -> Child:
    return Child(name, ["pdserve", "worker", *flags], "pdserve worker ready:")


def test_workers_alone_in_their_role_go_last_and_roles_come_from_the_role_flag():
    prefill = [worker(f"prefill worker {i}", "--role", "prefill") for i in range(2)]
    switched = worker("prefill worker 2", "--role", "decode")  # an autoscaled worker switched in place
    order, alone = worker_order([prefill[0], switched, prefill[1]])
    assert order == [prefill[0], prefill[1], switched] and alone == [switched]
    assert role_of(switched) == "decode" and role_of(Child("decode vllm 0", ["vllm"], "x")) == "decode"


def test_a_workers_drain_time_is_its_last_drain_seconds_flag():
    assert drain_seconds(worker("w", "--role", "decode")) == 30.0
    assert drain_seconds(worker("w", "--drain-seconds", "5", "--drain-seconds", "7.5")) == 7.5


def test_a_port_is_closed_once_nothing_listens_on_it_even_with_connections_open():
    with socket.create_server(("127.0.0.1", 0)) as server:
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        assert not port_closed(url)
    try:
        assert port_closed(url)  # the listener is gone; an established connection stays
    finally:
        client.close()
        accepted.close()


MAX_TOKENS = 32
CLIENTS = 2


class Unanswered(Exception):
    """No response came: the connection was refused (nothing listening: the coordinator's hand-over), or closed
    before the coordinator took the request (a draining coordinator closes the connections it has not read a
    request from). The request never started: a client tries it again."""


class Clients:
    """Client threads looping greedy streamed completions over GREEDY_PROMPTS, each on a new connection. A request
    that got no response is tried again; anything else that is not a complete stream is a failure."""

    def __init__(self, url: str):
        self.url = url
        self.stop = threading.Event()
        self.texts: list[tuple[float, str, str]] = []  # (ended at, prompt, text)
        self.failures: list[str] = []
        self.unanswered = 0
        self.done = [0] * CLIENTS
        self.threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(CLIENTS)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            if thread.ident is not None:  # started
                thread.join(120)

    def _loop(self, index: int) -> None:
        turn = index
        while not self.stop.is_set():
            prompt = GREEDY_PROMPTS[turn % len(GREEDY_PROMPTS)]
            try:
                text = complete(self.url, prompt)
            except Unanswered:
                self.unanswered += 1
                self.stop.wait(0.05)  # a client's retry backoff
                continue
            except Exception as exc:  # noqa: BLE001: every other failure is the test's to report
                self.failures.append(f"{prompt!r}: {type(exc).__name__}: {exc}")
            else:
                self.texts.append((time.monotonic(), prompt, text))
            self.done[index] += 1
            turn += 1


def complete(url: str, prompt: str) -> str:
    """The text of one greedy streamed /v1/completions, on a new connection; Unanswered if no response came."""
    with httpx.Client(timeout=120) as client:
        request = client.build_request("POST", f"{url}/v1/completions", json={
            "model": "pdserve-tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True})
        try:
            resp = client.send(request, stream=True)
        except httpx.TimeoutException:
            raise
        except httpx.TransportError as exc:
            raise Unanswered(f"{type(exc).__name__}: {exc}") from exc
        try:
            resp.read()
        finally:
            resp.close()
    assert resp.status_code == 200, f"{resp.status_code}: {resp.text[:2000]}"
    payloads = sse_events(resp.content)
    assert payloads[-1] == "[DONE]", payloads[-3:]
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert not any("error" in c for c in chunks), chunks[-3:]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


def pdserve_processes(up: ServerProcess) -> dict[int, str]:
    """The coordinator and worker processes of `pdserve up`, by pid."""
    found = {}
    for pid in descendants(up.proc.pid):
        try:
            line = cmdline(pid)
        except OSError:
            continue
        if " worker --role " in line or " coordinator --config " in line:
            found[pid] = line
    return found


@pytest.mark.system
@pytest.mark.long
def test_sigusr2_restarts_every_process_one_at_a_time_and_no_request_fails_or_changes(model_dir):
    up = ServerProcess(pdserve_argv("up", "--predict-port", str(free_port()), "--prefill", "2", "--decode", "2",
                                    "--model", str(model_dir)), "pdserve ready:", timeout_s=180)
    clients = Clients(up.address)
    before = pdserve_processes(up)
    after: dict[int, str] = {}
    try:
        assert len(before) == 5
        expected = {prompt: complete(up.address, prompt) for prompt in GREEDY_PROMPTS}
        clients.start()
        wait_for(lambda: all(clients.done), 60, "every client served once")

        log = lambda: "".join(up.output)  # noqa: E731
        os.kill(up.proc.pid, signal.SIGUSR2)
        wait_for(lambda: "rolling restart: prefill worker 0 draining" in log(), 60, "the first drain")
        signalled = time.monotonic()
        os.kill(up.proc.pid, signal.SIGUSR2)  # one rolling restart at a time
        wait_for(lambda: "SIGUSR2 ignored" in log(), 30, "the second SIGUSR2 ignored")
        wait_for(lambda: "rolling restart: done" in log(), 400, "the rolling restart done")
        finished = time.monotonic()
        served = list(clients.done)
        wait_for(lambda: all(now > then for now, then in zip(clients.done, served)), 60, "every client served after")
        clients.join()

        events = "".join(line for line in up.output if "rolling restart" in line or "level=warning" in line)
        assert clients.failures == [], "\n".join(clients.failures[:5]) + "\n" + events[-8000:]
        assert [(p, t) for _, p, t in clients.texts if t != expected[p]] == []
        assert sum(signalled <= at <= finished for at, _, _ in clients.texts) >= CLIENTS  # served while restarting
        after = pdserve_processes(up)
        assert not set(after) & set(before), (before, after)  # every process replaced ...
        roles = lambda found: sorted(re.search(r" (worker --role \w+|coordinator) ", c).group(1)  # noqa: E731
                                     for c in found.values())
        assert roles(after) == roles(before) == ["coordinator"] + ["worker --role decode"] * 2 + [
            "worker --role prefill"] * 2  # ... by one of its kind
        text = log()
        for pid in before:  # each one drained and exited by itself, in time
            assert f"(pid {pid}) exited by itself: exited with code 0" in text, f"pid {pid}:\n{text[-3000:]}"
        assert not re.search(r"; restart \d+ in ", text) and " is back at " not in text  # no crash among them
        for name in ("prefill worker 0", "prefill worker 1", "decode worker 0", "decode worker 1", "coordinator"):
            assert f"rolling restart: {name} back at " in text
        assert "rolling restart: warning" not in text  # no worker is alone in its role
    finally:
        clients.join()
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=60) == 0
    wait_for(lambda: not any(alive(p) for p in set(before) | set(after)), 10, "no process left")


def begin_rolling_restart(up: ServerProcess, log) -> None:
    """SIGUSR2 until a rolling restart begins: while the autoscaler acts (a loaded machine's planner may still be
    sizing the fleet) it answers "not now ... send SIGUSR2 again later"."""
    deadline = time.monotonic() + 120
    for attempt in range(1, 1000):
        os.kill(up.proc.pid, signal.SIGUSR2)
        said = wait_for(lambda: ("begun" if "one at a time, then the coordinator" in log() else "")
                        or ("later" if log().count("rolling restart: not now") >= attempt else ""), 60,
                        "an answer to SIGUSR2")
        if said == "begun":
            return
        assert time.monotonic() < deadline, log()[-3000:]
        time.sleep(0.5)  # a poll interval before asking again, not a wait for some state


@pytest.mark.system
def test_sigusr2_under_autoscale_restarts_a_lone_worker_last_and_the_workers_register_with_the_new_coordinator(
        model_dir):
    up = ServerProcess(pdserve_argv("up", "--predict-port", str(free_port()), "--prefill", "1", "--decode", "2",
                                    "--autoscale", "--model", str(model_dir), "--worker-args=--simulate"),
                       "pdserve ready:", timeout_s=180)
    before = pdserve_processes(up)
    after: dict[int, str] = {}
    log = lambda: "".join(up.output)  # noqa: E731
    try:
        begin_rolling_restart(up, log)
        wait_for(lambda: "rolling restart: done" in log() or "rolling restart: stopped" in log(), 300,
                 lambda: "the end; pdserve up said:\n" + log()[-6000:])
        text = log()
        assert "rolling restart: done" in text, text[-3000:]
        assert "rolling restart: warning: prefill worker 0 is the only prefill worker" in text
        drains = re.findall(r"rolling restart: (\w+ worker \d+) draining", text)
        assert drains == ["decode worker 1", "decode worker 2", "prefill worker 0"]  # the lone one last
        after = pdserve_processes(up)
        assert len(after) == 3 + 1 and not set(after) & set(before)
        for pid in before:
            assert f"(pid {pid}) exited by itself: exited with code 0" in text
        manage = next(line.split()[-1] for line in reversed(up.output)
                      if line.startswith("pdserve coordinator management:"))
        listed = httpx.get(f"{manage}/v1/instances", headers=registration_headers(up), timeout=10).json()
        assert sorted((role, i["state"], i["source"]) for role, group in listed.items() for i in group) == [
            ("decode", "healthy", "registered")] * 2 + [("prefill", "healthy", "registered")]
        resp = httpx.post(f"{up.address}/v1/completions", timeout=60,
                          json={"model": "pdserve-tiny", "prompt": "Hi", "max_tokens": 3})
        assert resp.status_code == 200, resp.text
    finally:
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=60) == 0
    wait_for(lambda: not any(alive(p) for p in set(before) | set(after)), 10, "no process left")
