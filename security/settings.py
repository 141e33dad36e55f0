"""The TLS and authentication settings of ms_coordinator.json, shared by the coordinator and the workers.

`tls_config` has one `TlsLink` group per link; both ends of a link read the same group shape with their
own files (the server side presents `tls_cert`, the client side presents it too when `mutual_tls`).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class TlsLink(_Section):
    """TLS on one link: CA, certificate, key, key password file, CRL, and whether peers must show a certificate."""

    tls_enable: bool = Field(False, description="Speak TLS on this link.")
    ca_cert: str = Field("", description="PEM CA bundle peers' certificates must chain to.")
    tls_cert: str = Field("", description="PEM certificate (chain) this side presents.")
    tls_key: str = Field("", description="PEM private key of tls_cert.")
    tls_passwd: str = Field("", description="File holding the password of an encrypted tls_key.")
    tls_crl: str = Field("", description="PEM CRL: peer certificates listed there are refused.")
    mutual_tls: bool = Field(False, description="The server requires a client certificate from ca_cert "
                             "(and clients present tls_cert).")

    def resolved(self, base: Path) -> TlsLink:
        """A copy whose relative file paths are taken from `base` (the config file's folder)."""
        return self.model_copy(update={k: _resolve(getattr(self, k), base) for k in _FILE_KEYS})


_FILE_KEYS = ("ca_cert", "tls_cert", "tls_key", "tls_passwd", "tls_crl")


def _resolve(value: str, base: Path) -> str:
    return str(base / value) if value and not Path(value).is_absolute() else value


class TlsConfig(_Section):
    """`tls_config`: one group per link."""

    predict: TlsLink = Field(TlsLink(), description="Clients -> coordinator predict port (every client API).")
    management: TlsLink = Field(TlsLink(), description="The coordinator's management port (registration, "
                                "instances, metrics): its server side.")
    worker_grpc: TlsLink = Field(TlsLink(), description="Coordinator -> workers' gRPC ports; gRPC PushKv "
                                 "(prefill -> decode) rides the decode worker's gRPC port and so follows it too.")
    registration: TlsLink = Field(TlsLink(), description="Workers -> coordinator management port: the "
                                  "workers' client side.")
    kv_transfer: TlsLink = Field(TlsLink(), description="Prefill -> decode KV data plane on the decode worker's "
                                 "raw-TCP KV port.")
    etcd: TlsLink = Field(TlsLink(), description="Coordinator -> etcd (backup_config.etcd_endpoints with "
                          "https://): the coordinator's client side; tls_cert and tls_key are presented when "
                          "mutual_tls.")
    epp: TlsLink = Field(TlsLink(), description="Gateway (Envoy) -> the endpoint picker's ext_proc port "
                         "(gateway_config.epp_port): its server side; mutual_tls to accept only the gateway.")

    def resolved(self, base: Path) -> TlsConfig:
        return TlsConfig(**{name: getattr(self, name).resolved(base) for name in TlsConfig.model_fields})


class AuthConfig(_Section):
    """`auth_config`: who may call the coordinator and who may join it."""

    api_keys_file: str = Field("", description="File of SHA-256 hex digests of API keys, one per line, '#' "
                               "comments (after a digest too); empty = the client APIs need no key.")
    open_health: bool = Field(True, description="GET /health and /health/live on the predict port answer "
                              "without an API key.")
    open_metrics: bool = Field(True, description="GET /metrics on the predict port answers without an API key.")
    registration_token_file: str = Field("", description="Workers must send this token to register when the "
                                         "management port has no mutual TLS; empty = registration is open.")
    worker_secret_file: str = Field("", description="Shared secret on every coordinator -> worker gRPC call "
                                    "when worker_grpc has no mutual TLS (workers refuse calls without it); empty = "
                                    "none.")

    def resolved(self, base: Path) -> AuthConfig:
        keys = ("api_keys_file", "registration_token_file", "worker_secret_file")
        return self.model_copy(update={k: _resolve(getattr(self, k), base) for k in keys})


class SecurityFile(BaseModel):
    """What a worker reads from its `--security-config` file: ms_coordinator.json itself, or a file with only
    `tls_config` and `auth_config` (other sections are the coordinator's and are skipped)."""

    model_config = ConfigDict(extra="ignore")

    tls_config: TlsConfig = TlsConfig()
    auth_config: AuthConfig = AuthConfig()


def load_security_file(path: str) -> SecurityFile:
    """Read and validate `path`; ValueError naming the file and the key on any problem."""
    import json

    from pydantic import ValidationError

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        loaded = SecurityFile.model_validate(data)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    except ValidationError as exc:
        lines = [f"{path}: {'.'.join(str(p) for p in e['loc'])}: "
                 f"{'unknown key' if e['type'] == 'extra_forbidden' else e['msg']}" for e in exc.errors()]
        raise ValueError("\n".join(lines)) from None
    base = Path(path).resolve().parent
    return SecurityFile(tls_config=loaded.tls_config.resolved(base), auth_config=loaded.auth_config.resolved(base))
