"""The coordinator's TLS links and secrets, loaded once at start-up and re-read on SIGHUP."""

from __future__ import annotations

from dataclasses import dataclass, fields

from aiohttp import web

from coordinator.config import ConfigError, CoordinatorConfig
from coordinator.errors import ApiError
from security.secrets import SecretFile, bearer_value, secret_file
from security.tls import LinkTls, link_tls


@dataclass
class CoordinatorTrust:
    """Its side of every link it is on, the worker secret it sends and the registration token it expects."""

    predict_tls: LinkTls | None = None
    management_tls: LinkTls | None = None
    epp_tls: LinkTls | None = None  # the endpoint picker's ext_proc port (gateway_config.epp_port)
    worker_tls: LinkTls | None = None
    worker_secret: SecretFile | None = None
    registration_token: SecretFile | None = None

    @classmethod
    def from_config(cls, config: CoordinatorConfig) -> CoordinatorTrust:
        """Read every file; raise TlsError or SecretError naming the key and the file."""
        tls, auth = config.tls_config, config.auth_config
        trust = cls(
            predict_tls=link_tls("tls_config.predict", tls.predict, "server"),
            management_tls=link_tls("tls_config.management", tls.management, "server"),
            epp_tls=link_tls("tls_config.epp", tls.epp, "server"),
            worker_tls=link_tls("tls_config.worker_grpc", tls.worker_grpc, "client"),
            worker_secret=secret_file("auth_config.worker_secret_file", auth.worker_secret_file),
            registration_token=secret_file("auth_config.registration_token_file", auth.registration_token_file),
        )
        if trust.worker_secret is not None and not trust.registration_proven:
            # The coordinator health-checks a worker as soon as it registers, sending the secret with the call.
            raise ConfigError("auth_config.worker_secret_file is set but anyone may register a worker, and a "
                              "registered address receives the secret: set auth_config.registration_token_file, "
                              "or tls_config.management with mutual_tls")
        return trust

    @property
    def _management_mutual(self) -> bool:
        return self.management_tls is not None and self.management_tls.mutual

    @property
    def registration_proven(self) -> bool:
        """Whether registering takes proof: mutual TLS on the management port, or the registration token."""
        return self._management_mutual or self.registration_token is not None

    @property
    def registration_needs_token(self) -> bool:
        """Without mutual TLS on the management port, a worker proves itself with the registration token."""
        return not self._management_mutual and self.registration_token is not None

    def parts(self) -> list[LinkTls | SecretFile]:
        """What SIGHUP re-reads: every link and secret that is set."""
        return [getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None]


TRUST = web.AppKey("trust", CoordinatorTrust)


def require_proof(request: web.Request) -> None:
    """401 unless the caller proved it belongs to the cluster (the token; or mutual TLS, checked at the handshake)."""
    trust = request.app[TRUST]
    if trust.registration_needs_token and not trust.registration_token.matches(
            bearer_value(request.headers.get("Authorization"))):
        raise ApiError(401, "registration needs proof: send Authorization: Bearer <the token in "
                       "auth_config.registration_token_file>, or a client certificate of the cluster CA "
                       "(tls_config.management with mutual_tls)",
                       headers={"WWW-Authenticate": 'Bearer realm="pdserve-registration"'})
