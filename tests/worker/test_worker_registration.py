"""A worker started with --coordinator registers, heartbeats, and deregisters on SIGTERM before it exits.

The coordinator side is a recording HTTP server here: what is under test is the worker's wiring;
the real coordinator's endpoints have their own tests.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.helpers import metrics_url, start_worker

pytestmark = pytest.mark.system


class RecordingManagementApi:
    """Answers /v1/instances/* as the coordinator's management API does, and records every call."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        calls = self.calls

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                calls.append((self.path.rsplit("/", 1)[-1], body))
                answer = json.dumps({"heartbeat_interval_s": 0.2} if self.path.endswith("register") else {})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer.encode())

            def log_message(self, *args):  # keep test output quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def actions(self) -> list[str]:
        return [action for action, _ in self.calls]


@pytest.fixture
def management_api():
    api = RecordingManagementApi()
    yield api
    api.server.shutdown()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_registers_heartbeats_and_deregisters_on_sigterm(model_dir, management_api, role):
    worker = start_worker(role, model_dir, "--coordinator", management_api.url, "--heartbeat-interval", "5")
    identity = {"role": role, "address": worker.address}
    deadline = time.monotonic() + 10
    while management_api.actions().count("heartbeat") < 2:  # the register answer's 0.2 s interval wins
        assert time.monotonic() < deadline, f"no heartbeats: {management_api.calls}"
        time.sleep(0.05)
    assert management_api.calls[0] == ("register", {**identity, "metrics_url": metrics_url(worker)})
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(timeout=30) == 0
    assert management_api.calls[-1] == ("deregister", identity)
