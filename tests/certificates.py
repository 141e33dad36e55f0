"""Real certificates for tests: a cluster CA (trustme), leaves for servers and clients, a client from another
CA, an expired one, a revoked one with the CRL that revokes it, and an encrypted key with its password file."""

from __future__ import annotations

import datetime
import ssl
from dataclasses import dataclass
from pathlib import Path

import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

HOSTS = ("127.0.0.1", "localhost")
KEY_PASSWORD = b"correct horse battery staple"


def _write_leaf(directory: Path, name: str, leaf: trustme.LeafCert) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.pem", directory / f"{name}-key.pem"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    return cert, key


def _crl(ca: trustme.CA, revoked: list[trustme.LeafCert]) -> bytes:
    ca_key = serialization.load_pem_private_key(ca.private_key_pem.bytes(), None)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem.bytes())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca_cert.subject).last_update(now)
               .next_update(now + datetime.timedelta(days=1)))
    for leaf in revoked:
        serial = x509.load_pem_x509_certificate(leaf.cert_chain_pems[0].bytes()).serial_number
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build())
    return builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


@dataclass
class Pki:
    """Files in `dir`: ca.pem, server/client/other-ca-client/expired-client/revoked-client(.pem, -key.pem),
    crl.pem (revokes revoked-client), empty-crl.pem, server-key-encrypted.pem + key-password."""

    dir: Path
    ca: trustme.CA

    def path(self, name: str) -> str:
        return str(self.dir / name)

    def link(self, leaf: str = "server", mutual: bool = True, crl: str | None = None, **extra) -> dict:
        """A tls_config group presenting `leaf`."""
        group = {"tls_enable": True, "mutual_tls": mutual, "ca_cert": self.path("ca.pem"),
                 "tls_cert": self.path(f"{leaf}.pem"), "tls_key": self.path(f"{leaf}-key.pem")}
        if crl:
            group["tls_crl"] = self.path(crl)
        return {**group, **extra}

    def client_context(self, leaf: str | None = "client") -> ssl.SSLContext:
        """What a client presents: the cluster CA as trust, `leaf`'s certificate (None: no certificate)."""
        ctx = ssl.create_default_context(cafile=self.path("ca.pem"))
        if leaf is not None:
            ctx.load_cert_chain(self.path(f"{leaf}.pem"), self.path(f"{leaf}-key.pem"))
        return ctx


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    _write_leaf(directory, "server", ca.issue_cert(*HOSTS, common_name="server"))
    _write_leaf(directory, "client", ca.issue_cert("client", common_name="client"))
    revoked = ca.issue_cert("revoked", common_name="revoked-client")
    _write_leaf(directory, "revoked-client", revoked)
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=30)
    _write_leaf(directory, "expired-client", ca.issue_cert("expired", common_name="expired-client",
                                                           not_before=past, not_after=past + datetime.timedelta(days=1)))
    _write_leaf(directory, "expired-server", ca.issue_cert(*HOSTS, common_name="expired-server",
                                                           not_before=past, not_after=past + datetime.timedelta(days=1)))
    _write_leaf(directory, "other-ca-client", trustme.CA().issue_cert("intruder", common_name="intruder"))
    _write_leaf(directory, "server2", ca.issue_cert(*HOSTS, common_name="server-renewed"))
    (directory / "crl.pem").write_bytes(_crl(ca, [revoked]))
    (directory / "empty-crl.pem").write_bytes(_crl(ca, []))
    key = serialization.load_pem_private_key((directory / "server-key.pem").read_bytes(), None)
    (directory / "server-key-encrypted.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(KEY_PASSWORD)))
    (directory / "key-password").write_bytes(KEY_PASSWORD + b"\n")
    (directory / "wrong-password").write_bytes(b"not it\n")
    return Pki(directory, ca)
