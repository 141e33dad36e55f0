"""Bad TLS files fail start-up naming the key and the file; good ones give working contexts."""

from __future__ import annotations

import asyncio
import shutil

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from security.settings import TlsLink
from security.tls import LinkTls, TlsError
from tests.certificates import make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def settings(pki, **overrides) -> TlsLink:
    return TlsLink(**pki.link("server", **overrides))


def refusal(pki, side="server", **overrides) -> str:
    with pytest.raises(TlsError) as exc:
        LinkTls("tls_config.predict", settings(pki, **overrides), side)
    return str(exc.value)


def test_a_missing_file_names_the_key_and_the_path(pki):
    message = refusal(pki, tls_cert=pki.path("nope.pem"))
    assert "tls_config.predict.tls_cert" in message and "nope.pem" in message


def test_a_key_that_is_not_a_key_is_refused(pki):
    message = refusal(pki, tls_key=pki.path("ca.pem"))
    assert "tls_config.predict.tls_key" in message and "not a PEM private key" in message


def test_a_key_of_another_certificate_is_refused(pki):
    message = refusal(pki, tls_key=pki.path("client-key.pem"))
    assert "does not match" in message and "client-key.pem" in message and "server.pem" in message


def test_an_encrypted_key_needs_its_password_file(pki):
    message = refusal(pki, tls_key=pki.path("server-key-encrypted.pem"))
    assert "tls_config.predict.tls_key" in message and "encrypted" in message and "tls_passwd" in message


def test_a_wrong_password_names_the_password_file(pki):
    message = refusal(pki, tls_key=pki.path("server-key-encrypted.pem"), tls_passwd=pki.path("wrong-password"))
    assert "tls_config.predict.tls_passwd" in message and "wrong-password" in message


def test_an_encrypted_key_with_its_password_loads(pki):
    tls = LinkTls("tls_config.predict", settings(pki, tls_key=pki.path("server-key-encrypted.pem"),
                                                 tls_passwd=pki.path("key-password")), "server")
    assert tls.ssl_context() is not None
    assert tls.grpc_server_credentials() is not None


def test_an_expired_certificate_is_refused(pki):
    message = refusal(pki, tls_cert=pki.path("expired-server.pem"), tls_key=pki.path("expired-server-key.pem"))
    assert "tls_config.predict.tls_cert" in message and "expired" in message


def test_a_broken_crl_is_refused(pki):
    message = refusal(pki, tls_crl=pki.path("server.pem"))
    assert "tls_config.predict.tls_crl" in message and "not a PEM CRL" in message


def test_mutual_tls_on_a_server_needs_a_ca(pki):
    assert "ca_cert" in refusal(pki, ca_cert="")


def test_a_client_without_mutual_tls_needs_no_certificate(pki):
    tls = LinkTls("tls_config.worker_grpc", TlsLink(tls_enable=True, ca_cert=pki.path("ca.pem")), "client")
    assert tls.ssl_context() is not None and tls.grpc_channel_credentials() is not None


def test_reload_picks_up_new_files_and_a_broken_one_keeps_the_old(pki, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    shutil.copy(pki.path("server.pem"), cert)
    shutil.copy(pki.path("server-key.pem"), key)
    tls = LinkTls("tls_config.predict", settings(pki, tls_cert=str(cert), tls_key=str(key)), "server")
    first = tls.ssl_context()
    shutil.copy(pki.path("server2.pem"), cert)
    shutil.copy(pki.path("server2-key.pem"), key)
    tls.reload()
    assert tls.generation == 1 and tls.ssl_context() is not first
    shutil.copy(pki.path("client-key.pem"), key)  # a half-replaced pair: refused, the working pair stays
    with pytest.raises(TlsError):
        tls.reload()
    assert tls.generation == 1


def test_the_crl_lists_the_revoked_client_only(pki):
    tls = LinkTls("tls_config.worker_grpc", settings(pki, crl="crl.pem"), "server")
    assert tls.is_revoked((pki.dir / "revoked-client.pem").read_bytes())
    assert not tls.is_revoked((pki.dir / "client.pem").read_bytes())


async def test_a_grpc_server_serves_the_reloaded_certificate_to_new_connections(pki, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    shutil.copy(pki.path("server.pem"), cert)
    shutil.copy(pki.path("server-key.pem"), key)
    tls = LinkTls("tls_config.worker_grpc", settings(pki, tls_cert=str(cert), tls_key=str(key)), "server")
    server = grpc.aio.server()
    port = server.add_secure_port("127.0.0.1:0", tls.grpc_server_credentials())
    await server.start()

    async def served_common_name() -> str:
        ctx = pki.client_context("client")
        ctx.set_alpn_protocols(["h2"])  # gRPC's TLS insists on HTTP/2
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="127.0.0.1")
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.close()
        return x509.load_der_x509_certificate(der).subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value

    try:
        assert await served_common_name() == "server"
        shutil.copy(pki.path("server2.pem"), cert)
        shutil.copy(pki.path("server2-key.pem"), key)
        tls.reload()
        assert await served_common_name() == "server-renewed"
    finally:
        await server.stop(None)
