"""EtcdStore without etcd: endpoints tried in order, reachability tracked, an outage counted once it ends."""

from __future__ import annotations

import json

import pytest
import requests
from etcd3gw.exceptions import ConnectionFailedError, Etcd3Exception

from coordinator.cluster.etcd_store import EtcdError, EtcdStore, EtcdUnavailable


class Client:
    def __init__(self, up: bool = True):
        self.up = up

    def get(self, key, metadata=False):
        if not self.up:
            raise ConnectionFailedError("refused")
        return [(b"v", {"key": key.encode(), "mod_revision": "7", "lease": "42"})]


async def test_the_next_endpoint_answers_when_one_is_down():
    store = EtcdStore(["http://a:1", "http://b:1"], 1, clients=[Client(up=False), Client()])
    entry = await store.get("/k")
    assert (entry.key, entry.value, entry.lease, entry.mod_revision) == ("/k", b"v", 42, 7)
    assert store.reachable and store.status()["error"] == ""
    store.close()


async def test_an_outage_is_reported_then_counted_when_it_ends():
    clients = [Client(up=False), Client(up=False)]
    store = EtcdStore(["http://a:1", "http://b:1"], 1, clients=clients)
    with pytest.raises(EtcdUnavailable):
        await store.get("/k")
    status = store.status()
    assert status["reachable"] is False and status["since"] > 0
    assert "http://a:1" in status["error"] and "http://b:1" in status["error"]
    clients[1].up = True
    await store.get("/k")
    assert store.reachable and store.unreachable_since is None and store.num_reconnects == 1
    store.close()


async def test_a_refusal_is_an_error_but_not_an_outage():
    class Refusing(Client):
        def get(self, key, metadata=False):
            raise Etcd3Exception("lease not found")

    store = EtcdStore(["http://a:1"], 1, clients=[Refusing()])
    with pytest.raises(EtcdError, match="lease not found") as err:
        await store.get("/k")
    assert not isinstance(err.value, EtcdUnavailable) and store.reachable
    store.close()


@pytest.mark.parametrize("failure", [requests.exceptions.ChunkedEncodingError("connection cut mid-body"),
                                     json.JSONDecodeError("Expecting value", "<html>", 0), ValueError("not JSON")])
async def test_a_reply_cut_short_or_not_json_is_no_answer(failure):
    class Broken(Client):
        def get(self, key, metadata=False):
            raise failure

    store = EtcdStore(["http://a:1", "http://b:1"], 1, clients=[Broken(), Client()])
    assert (await store.get("/k")).value == b"v" and store.reachable  # the next endpoint answers
    store.close()
    store = EtcdStore(["http://a:1"], 1, clients=[Broken()])
    with pytest.raises(EtcdUnavailable, match=type(failure).__name__):
        await store.get("/k")
    assert not store.reachable
    store.close()


def test_one_call_across_all_endpoints_stays_within_the_timeout():
    store = EtcdStore(["http://a:1", "http://b:1", "http://c:1"], 1.5)
    assert store.timeout_s == 1.5 and [c.timeout for c in store._clients] == [0.5, 0.5, 0.5]
    store.close()
