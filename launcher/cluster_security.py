"""The local cluster's trust: a worker secret and a registration token always, mutual TLS on every link with
`--tls DIR`, API keys with `--api-keys FILE`. Written as the coordinator's config sections and one `--security-config` file for workers."""

from __future__ import annotations

import json
import secrets
import ssl
from dataclasses import dataclass
from pathlib import Path

from security.certificates import ensure_local_certificates, write_private

LINKS = ("predict", "management", "worker_grpc", "registration", "kv_transfer")


def _link(tls_dir: Path, leaf: str) -> dict:
    return {"tls_enable": True, "mutual_tls": True, "ca_cert": str(tls_dir / "ca.pem"),
            "tls_cert": str(tls_dir / f"{leaf}.pem"), "tls_key": str(tls_dir / f"{leaf}-key.pem")}


@dataclass(frozen=True)
class ClusterSecurity:
    """Files for one `pdserve up` run, kept in `run_dir`."""

    run_dir: Path
    tls_dir: Path | None
    api_keys_file: str | None

    @classmethod
    def prepare(cls, run_dir: Path, tls_dir: str | None, api_keys_file: str | None) -> ClusterSecurity:
        made = cls(run_dir, ensure_local_certificates(tls_dir).resolve() if tls_dir else None,
                   str(Path(api_keys_file).resolve()) if api_keys_file else None)
        # Without mutual TLS on the worker ports, this secret is what keeps strangers from submitting work; the
        # registration token keeps strangers from registering an address and receiving it.
        write_private(run_dir / "worker-secret", secrets.token_urlsafe(32).encode() + b"\n")
        write_private(run_dir / "registration-token", secrets.token_urlsafe(32).encode() + b"\n")
        write_private(run_dir / "workers.json", json.dumps(made._sections(role="worker"), indent=2).encode())
        return made

    @property
    def scheme(self) -> str:
        return "https" if self.tls_dir else "http"

    @property
    def worker_security_file(self) -> Path:
        return self.run_dir / "workers.json"

    def coordinator_sections(self) -> dict:
        """`tls_config` and `auth_config` for the coordinator's ms_coordinator.json."""
        return self._sections(role="coordinator")

    def _sections(self, role: str) -> dict:
        auth = {"worker_secret_file": str(self.run_dir / "worker-secret"),
                "registration_token_file": str(self.run_dir / "registration-token")}
        if self.api_keys_file and role == "coordinator":
            auth["api_keys_file"] = self.api_keys_file
        sections = {"auth_config": auth}
        if self.tls_dir:
            # The coordinator serves its ports with the server certificate and dials workers with the client
            # one; workers serve with the server certificate and dial other parties with the client one.
            leaves = {"predict": "server", "management": "server", "worker_grpc": "client" if role == "coordinator"
                      else "server", "registration": "client", "kv_transfer": "server"}
            sections["tls_config"] = {link: _link(self.tls_dir, leaves[link]) for link in LINKS}
            if role == "coordinator":  # its endpoint picker's port, which Envoy dials with the client certificate
                sections["tls_config"]["epp"] = _link(self.tls_dir, "server")
        return sections

    def envoy_tls(self) -> dict:
        """`render_bootstrap`'s TLS arguments for `pdserve up --gateway envoy`: mutual TLS on each of Envoy's links."""
        if not self.tls_dir:
            return {}
        ca, client = str(self.tls_dir / "ca.pem"), (str(self.tls_dir / "client.pem"),
                                                    str(self.tls_dir / "client-key.pem"))
        return {"epp_tls": (ca, *client), "sidecar_tls": (ca, *client),
                "client_tls": (str(self.tls_dir / "server.pem"), str(self.tls_dir / "server-key.pem"), ca)}

    def client_ssl_context(self) -> ssl.SSLContext | None:
        """What a local client (the launcher's health check) presents to the coordinator."""
        if not self.tls_dir:
            return None
        ctx = ssl.create_default_context(cafile=str(self.tls_dir / "ca.pem"))
        ctx.load_cert_chain(str(self.tls_dir / "client.pem"), str(self.tls_dir / "client-key.pem"))
        return ctx
