"""tls_config.etcd against a real etcd serving https with client certificates (mutual TLS)."""

from __future__ import annotations

import pytest

from coordinator.cluster.etcd_store import EtcdStore, EtcdUnavailable
from coordinator.config import parse_config
from security.settings import TlsLink
from tests.certificates import make_pki
from tests.etcd_server import EtcdServer

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_etcd(pki, tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd-tls"),
                        tls=(pki.path("server.pem"), pki.path("server-key.pem"), pki.path("ca.pem"))).start()
    yield server
    server.stop()


async def test_a_coordinator_speaks_to_etcd_over_mutual_tls(pki, tls_etcd):
    config = parse_config({"backup_config": {"etcd_endpoints": [tls_etcd.url]},
                           "tls_config": {"etcd": pki.link("client")}})
    store = EtcdStore(config.backup_config.etcd_endpoints, 2, config.tls_config.etcd)
    lease = await store.grant(3)
    await store.put("/tls/k", "v", lease)
    assert (await store.get("/tls/k")).value == b"v"
    assert await store.create("/tls/k", "w") is not None  # held: the transaction names the holder
    store.close()


@pytest.mark.parametrize("link", [
    {"tls_enable": True, "ca_cert": "ca.pem"},  # no client certificate
    {"tls_enable": True, "ca_cert": "ca.pem", "mutual_tls": True, "tls_cert": "other-ca-client.pem",
     "tls_key": "other-ca-client-key.pem"},  # a certificate of another CA
])
async def test_etcd_refuses_a_coordinator_without_a_cluster_certificate(pki, tls_etcd, link):
    link = TlsLink(**link).resolved(pki.dir)
    store = EtcdStore([tls_etcd.url], 2, link)
    with pytest.raises(EtcdUnavailable):
        await store.get("/tls/k")
    assert store.status()["reachable"] is False and store.status()["error"]
    store.close()
