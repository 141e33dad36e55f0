"""Read and check one link's TLS files, so a bad file fails start-up (or a reload) naming the key and the file.

Checked: every file is readable PEM of the right kind, the certificate is within its validity period,
an encrypted key has a password file and the password opens it, the key belongs to the certificate,
and the CRL parses. The key is kept decrypted in memory only (gRPC takes key bytes, not a password).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from security.settings import TlsLink

Side = Literal["server", "client"]


class TlsError(Exception):
    """A TLS file that cannot be used; the message names the config key and the file."""


@dataclass(frozen=True)
class TlsMaterial:
    """The checked contents of one link's files for one side of it."""

    link: str  # the config path of the group, e.g. "tls_config.predict"
    settings: TlsLink
    side: Side
    ca_pem: bytes | None
    cert_pem: bytes | None
    key_pem: bytes | None  # unencrypted PKCS#8
    key_password: bytes | None
    revoked_serials: frozenset[int]

    @property
    def presents_certificate(self) -> bool:
        return self.cert_pem is not None

    @property
    def verifies_peer(self) -> bool:
        """Servers verify clients only with mutual TLS; clients always verify the server."""
        return self.side == "client" or self.settings.mutual_tls


def _read(link: str, key: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TlsError(f"{link}.{key}: cannot read {path}: {exc.strerror or exc}") from None


def _check_validity(link: str, key: str, path: str, cert: x509.Certificate) -> None:
    now = datetime.datetime.now(datetime.timezone.utc)
    if cert.not_valid_after_utc < now:
        raise TlsError(f"{link}.{key}: certificate in {path} expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")
    if cert.not_valid_before_utc > now:
        raise TlsError(f"{link}.{key}: certificate in {path} is not valid before "
                       f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC")


def _certificates(link: str, key: str, path: str) -> tuple[bytes, list[x509.Certificate]]:
    data = _read(link, key, path)
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        raise TlsError(f"{link}.{key}: {path} holds no PEM certificate") from None
    for cert in certs[:1]:  # the leaf; a bundle may carry older intermediates or CAs
        _check_validity(link, key, path, cert)
    return data, certs


def _private_key(link: str, settings: TlsLink) -> tuple[bytes, bytes | None, object]:
    data = _read(link, "tls_key", settings.tls_key)
    password = None
    if settings.tls_passwd:
        password = _read(link, "tls_passwd", settings.tls_passwd).rstrip(b"\r\n")
    try:
        key = serialization.load_pem_private_key(data, password)
    except TypeError:
        if password is None:
            raise TlsError(f"{link}.tls_key: {settings.tls_key} is encrypted: set {link}.tls_passwd "
                           f"to a file holding its password") from None
        key = serialization.load_pem_private_key(data, None)  # not encrypted: the password is unused
    except ValueError:
        if password is not None:
            raise TlsError(f"{link}.tls_passwd: the password in {settings.tls_passwd} does not open "
                           f"{link}.tls_key {settings.tls_key} (or it is not a PEM private key)") from None
        raise TlsError(f"{link}.tls_key: {settings.tls_key} is not a PEM private key") from None
    plain = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption())
    return plain, password, key


def _public(obj) -> bytes:
    return obj.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _revoked(link: str, path: str) -> frozenset[int]:
    data = _read(link, "tls_crl", path)
    try:
        crl = x509.load_pem_x509_crl(data)
    except ValueError:
        raise TlsError(f"{link}.tls_crl: {path} is not a PEM CRL") from None
    return frozenset(entry.serial_number for entry in crl)


def load_material(link: str, settings: TlsLink, side: Side) -> TlsMaterial:
    """Read and check `settings` for `side` of the link named `link`; raise TlsError naming what is wrong."""
    needs_cert = side == "server" or settings.mutual_tls
    needs_ca = side == "server" and settings.mutual_tls
    for key, needed in (("tls_cert", needs_cert), ("tls_key", needs_cert), ("ca_cert", needs_ca)):
        if needed and not getattr(settings, key):
            why = "mutual_tls is on" if key == "ca_cert" or side == "client" else "this side serves TLS"
            raise TlsError(f"{link}.{key}: required ({why})")
    ca_pem = _certificates(link, "ca_cert", settings.ca_cert)[0] if settings.ca_cert else None
    cert_pem = key_pem = password = None
    if needs_cert:
        cert_pem, certs = _certificates(link, "tls_cert", settings.tls_cert)
        key_pem, password, key = _private_key(link, settings)
        if _public(key.public_key()) != _public(certs[0].public_key()):
            raise TlsError(f"{link}.tls_key: {settings.tls_key} does not match the certificate in "
                           f"{link}.tls_cert {settings.tls_cert}")
    revoked = _revoked(link, settings.tls_crl) if settings.tls_crl else frozenset()
    return TlsMaterial(link, settings, side, ca_pem, cert_pem, key_pem, password, revoked)
