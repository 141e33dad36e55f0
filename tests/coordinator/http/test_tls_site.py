"""The TLS listener: mutual TLS refusals, plain HTTP answered with a 400, certificates reloaded for new connections."""

from __future__ import annotations

import asyncio
import shutil
import ssl

import httpx
import pytest
from aiohttp import web
from cryptography import x509

from coordinator.http.route_table import ROUTE_TABLE, ErrorStyle, Route, RouteTable
from coordinator.http.server import plain_http_reply
from coordinator.http.tls_site import TlsSite
from security.settings import TlsLink
from security.tls import LinkTls
from tests.certificates import make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


async def ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def serve(tls: LinkTls, handshake_timeout_s: float = 5.0):
    app = web.Application()
    app[ROUTE_TABLE] = RouteTable([Route("GET", "/v1/models", ok, ErrorStyle.OPENAI),
                                   Route("GET", "/info", ok, ErrorStyle.TGI)])
    app[ROUTE_TABLE].add_to(app)
    runner = web.AppRunner(app)
    await runner.setup()
    site = TlsSite(runner, "127.0.0.1", 0, tls, plain_http_reply(app), handshake_timeout_s)
    await site.start()
    return runner, site, f"https://127.0.0.1:{site.port}"


async def get(url: str, ctx: ssl.SSLContext | None = None, path: str = "/v1/models") -> httpx.Response:
    async with httpx.AsyncClient(verify=ctx if ctx is not None else False, timeout=5) as client:
        return await client.get(url + path)


def link(pki, tmp_path=None, **overrides) -> LinkTls:
    return LinkTls("tls_config.predict", TlsLink(**pki.link("server", **overrides)), "server")


async def test_a_client_with_a_certificate_of_the_cluster_ca_is_served(pki):
    runner, _, url = await serve(link(pki))
    try:
        assert (await get(url, pki.client_context("client"))).json() == {"ok": True}
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("leaf", [None, "other-ca-client", "expired-client", "revoked-client"])
async def test_clients_without_a_good_certificate_are_refused_and_the_server_keeps_serving(pki, leaf):
    runner, _, url = await serve(link(pki, crl="crl.pem"))
    try:
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            await get(url, pki.client_context(leaf))
        assert (await get(url, pki.client_context("client"))).status_code == 200
    finally:
        await runner.cleanup()


async def test_plain_http_to_the_tls_port_is_a_400_in_the_api_format(pki):
    runner, _, url = await serve(link(pki))
    plain = url.replace("https://", "http://")
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            openai = await client.get(plain + "/v1/models")
            tgi = await client.get(plain + "/info")
        assert openai.status_code == 400 and "https://" in openai.json()["error"]["message"]
        assert tgi.status_code == 400 and "https://" in tgi.json()["error"]
    finally:
        await runner.cleanup()


async def test_a_client_that_connects_and_sends_nothing_is_dropped(pki):
    runner, site, url = await serve(link(pki), handshake_timeout_s=0.3)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
        writer.close()
    finally:
        await runner.cleanup()


async def test_reload_serves_the_new_certificate_to_new_connections(pki, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    shutil.copy(pki.path("server.pem"), cert)
    shutil.copy(pki.path("server-key.pem"), key)
    tls = link(pki, tls_cert=str(cert), tls_key=str(key))
    runner, site, url = await serve(tls)

    async def served_common_name() -> str:
        ctx = pki.client_context("client")
        reader, writer = await asyncio.open_connection("127.0.0.1", site.port, ssl=ctx, server_hostname="127.0.0.1")
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.close()
        return x509.load_der_x509_certificate(der).subject.rfc4514_string()

    try:
        assert "CN=server" in await served_common_name()
        shutil.copy(pki.path("server2.pem"), cert)
        shutil.copy(pki.path("server2-key.pem"), key)
        tls.reload()
        assert "CN=server-renewed" in await served_common_name()
    finally:
        await runner.cleanup()


async def test_a_new_crl_applies_after_reload(pki, tmp_path):
    crl = tmp_path / "crl.pem"
    shutil.copy(pki.path("empty-crl.pem"), crl)
    tls = link(pki, tls_crl=str(crl))
    runner, _, url = await serve(tls)
    try:
        assert (await get(url, pki.client_context("revoked-client"))).status_code == 200
        shutil.copy(pki.path("crl.pem"), crl)
        tls.reload()
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            await get(url, pki.client_context("revoked-client"))
    finally:
        await runner.cleanup()
