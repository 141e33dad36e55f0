"""A local CA and certificates for `pdserve up --tls DIR` (made once; files already in DIR are kept).

DIR gets ca.pem (+ ca-key.pem), server.pem / server-key.pem (for 127.0.0.1, ::1, localhost and this
host's name) and client.pem / client-key.pem; both leaves may serve and authenticate as clients, since
a worker is a server on its gRPC port and a client of the next link.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

FILES = ("ca.pem", "server.pem", "server-key.pem", "client.pem", "client-key.pem")
VALID_DAYS = 825  # what browsers and most clients accept for a leaf


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdserve local cluster"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def write_private(path: Path, data: bytes) -> None:
    """Write a key or a secret readable by its owner only (also when the file was already there)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_key(path: Path, key) -> None:
    write_private(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _builder(subject: x509.Name, issuer: x509.Name, public_key, days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days)))


def _leaf(ca_key, ca_cert: x509.Certificate, common_name: str, hosts: list[str]):
    key = ec.generate_private_key(ec.SECP256R1())
    names = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    builder = (_builder(_name(common_name), ca_cert.subject, key.public_key(), VALID_DAYS)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                     ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def _load_ca(directory: Path):
    ca_cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((directory / "ca-key.pem").read_bytes(), None)
    return ca_key, ca_cert


def _new_ca(directory: Path):
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("pdserve local CA")
    ca_cert = (_builder(ca_name, ca_name, ca_key.public_key(), 3650)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, encipher_only=False,
                                            decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    _write_cert(directory / "ca.pem", ca_cert)
    _write_key(directory / "ca-key.pem", ca_key)
    return ca_key, ca_cert


def ensure_local_certificates(directory: str | Path) -> Path:
    """Create what DIR lacks: the CA (unless ca.pem is there), then each missing certificate and key pair;
    return DIR. A ca.pem without its ca-key.pem cannot issue the missing ones: ValueError saying so."""
    directory = Path(directory)
    if all((directory / name).exists() for name in FILES):
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / "ca.pem").exists():
        if not (directory / "ca-key.pem").exists():
            raise ValueError(f"{directory} has ca.pem but not ca-key.pem, so the missing certificates cannot be "
                             f"issued: add ca-key.pem, or empty the folder to make a new CA")
        ca_key, ca_cert = _load_ca(directory)
    else:
        ca_key, ca_cert = _new_ca(directory)
    hosts = ["127.0.0.1", "::1", "localhost", socket.gethostname()]
    for role, common_name in (("server", "pdserve server"), ("client", "pdserve client")):
        if (directory / f"{role}.pem").exists() and (directory / f"{role}-key.pem").exists():
            continue
        key, cert = _leaf(ca_key, ca_cert, common_name, hosts)
        _write_cert(directory / f"{role}.pem", cert)
        _write_key(directory / f"{role}-key.pem", key)
    return directory
