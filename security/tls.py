"""One side of one TLS link, re-readable at run time: ssl contexts for HTTP and raw sockets, gRPC credentials.

Every new connection takes the material current at its start, so after `reload()` (SIGHUP) new
handshakes use the new certificate, key, CA and CRL while connections in flight finish on the old.
"""

from __future__ import annotations

import logging
import ssl
import threading

import grpc
from cryptography import x509

from security.settings import TlsLink
from security.tls_material import Side, TlsError, TlsMaterial, load_material

logger = logging.getLogger(__name__)

__all__ = ["LinkTls", "TlsError", "link_tls"]


def _ssl_context(material: TlsMaterial) -> ssl.SSLContext:
    s = material.settings
    if material.side == "server":
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.verify_mode = ssl.CERT_REQUIRED if s.mutual_tls else ssl.CERT_NONE
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the server's certificate and host name
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if material.presents_certificate:
        ctx.load_cert_chain(s.tls_cert, s.tls_key, password=material.key_password)
    if material.verifies_peer:
        if material.ca_pem is not None:
            ctx.load_verify_locations(cadata=material.ca_pem.decode())
        else:
            ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
        if s.tls_crl:
            ctx.load_verify_locations(cafile=s.tls_crl)
            ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    return ctx


class LinkTls:
    """The current TLS material of one side of one link, with what each transport needs built from it."""

    def __init__(self, link: str, settings: TlsLink, side: Side):
        self.link = link
        self.settings = settings
        self.side = side
        self._lock = threading.Lock()  # the raw-TCP KV receiver reads contexts from worker threads
        self._material, self._ssl = self._load()
        self.generation = 0

    @property
    def name(self) -> str:
        return f"{self.link} ({self.side})"

    @property
    def mutual(self) -> bool:
        return self.settings.mutual_tls

    def _load(self) -> tuple[TlsMaterial, ssl.SSLContext]:
        """Check the files and build the ssl context at once, so what serves is what was checked."""
        material = load_material(self.link, self.settings, self.side)
        try:
            return material, _ssl_context(material)
        except ssl.SSLError as exc:
            raise TlsError(f"{self.link}: OpenSSL refused the files: {exc}") from None

    def reload(self) -> None:
        """Re-read every file; on any error keep the current material and raise TlsError.

        `generation` moves only when the material changed, so an idle SIGHUP opens no new channels."""
        material, context = self._load()
        with self._lock:
            changed = _fingerprint(material) != _fingerprint(self._material)
            self._material, self._ssl = material, context
            if changed:
                self.generation += 1

    def ssl_context(self) -> ssl.SSLContext:
        """The ssl context for new connections."""
        with self._lock:
            return self._ssl

    # gRPC -----------------------------------------------------------------------------------------

    def grpc_server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials that pick up reloaded material on the next handshake."""
        seen = {"generation": self.generation}

        def fetch():
            if seen["generation"] == self.generation:
                return None
            seen["generation"] = self.generation
            return self._grpc_certificate_configuration()

        return grpc.dynamic_ssl_server_credentials(self._grpc_certificate_configuration(), fetch,
                                                   require_client_authentication=self.mutual)

    def _grpc_certificate_configuration(self):
        m = self._material
        return grpc.ssl_server_certificate_configuration([(m.key_pem, m.cert_pem)],
                                                         root_certificates=m.ca_pem if self.mutual else None)

    def grpc_channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials for channels opened now (a reload changes `generation`: open new channels)."""
        m = self._material
        if m.presents_certificate:
            return grpc.ssl_channel_credentials(m.ca_pem, m.key_pem, m.cert_pem)
        return grpc.ssl_channel_credentials(m.ca_pem)

    def is_revoked(self, peer_pem: bytes) -> bool:
        """Whether a peer certificate is listed in the current CRL (gRPC servers check this per call)."""
        revoked = self._material.revoked_serials
        if not revoked:
            return False
        return x509.load_pem_x509_certificate(peer_pem).serial_number in revoked


def _fingerprint(m: TlsMaterial) -> tuple:
    return m.ca_pem, m.cert_pem, m.key_pem, m.revoked_serials


def link_tls(link: str, settings: TlsLink, side: Side) -> LinkTls | None:
    """The link's TLS for `side`, or None when the link is plaintext."""
    return LinkTls(link, settings, side) if settings.tls_enable else None
