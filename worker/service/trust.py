"""A worker's TLS links and secrets, from its --security-config file and flags; re-read on SIGHUP."""

from __future__ import annotations

from dataclasses import dataclass, fields

from security.secrets import SecretFile, secret_file
from security.settings import AuthConfig, TlsConfig
from security.tls import LinkTls, link_tls


@dataclass
class WorkerTrust:
    """Its side of each link it is on."""

    grpc_server: LinkTls | None = None  # its gRPC port (coordinator calls, gRPC PushKv into a decode worker)
    grpc_client: LinkTls | None = None  # prefill: dialing a decode worker's gRPC port for PushKv
    kv_server: LinkTls | None = None  # decode: its raw-TCP KV port
    kv_client: LinkTls | None = None  # prefill: dialing a decode worker's raw-TCP KV port
    registration: LinkTls | None = None  # registering with the coordinator's management port
    worker_secret: SecretFile | None = None  # what gRPC callers must present
    registration_token: SecretFile | None = None  # what it presents to register

    @classmethod
    def from_settings(cls, role: str, tls: TlsConfig, auth: AuthConfig) -> WorkerTrust:
        """Read every file this role uses; raise TlsError or SecretError naming the key and the file."""
        prefill = role == "prefill"
        return cls(
            grpc_server=link_tls("tls_config.worker_grpc", tls.worker_grpc, "server"),
            grpc_client=link_tls("tls_config.worker_grpc", tls.worker_grpc, "client") if prefill else None,
            kv_server=None if prefill else link_tls("tls_config.kv_transfer", tls.kv_transfer, "server"),
            kv_client=link_tls("tls_config.kv_transfer", tls.kv_transfer, "client") if prefill else None,
            registration=link_tls("tls_config.registration", tls.registration, "client"),
            worker_secret=secret_file("auth_config.worker_secret_file", auth.worker_secret_file),
            registration_token=secret_file("auth_config.registration_token_file", auth.registration_token_file),
        )

    def parts(self) -> list[LinkTls | SecretFile]:
        """What SIGHUP re-reads: every link and secret that is set."""
        return [getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None]
