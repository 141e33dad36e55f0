"""A coordinator app on an etcd it cannot reach: it starts, stays a standby, and says why on /health."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from coordinator.http.app import create_app
from coordinator.cluster.leadership import Role
from coordinator.cluster.node import coordinator_name
from coordinator.config import parse_config
from coordinator.state import STATE
from tests.etcd_server import free_port


def test_the_default_name_is_the_predict_address():
    assert coordinator_name(parse_config({"http_config": {"predict_ip": "10.0.0.7", "predict_port": 1025}})) == \
        "10.0.0.7:1025"
    assert coordinator_name(parse_config({"backup_config": {"coordinator_name": "east-1"}})) == "east-1"


def test_without_etcd_endpoints_a_coordinator_stands_alone(model_dir):
    app = create_app(parse_config({"model_config": {"modelWeightPath": str(model_dir)}}))
    assert app[STATE].cluster is None


async def test_a_coordinator_that_cannot_reach_etcd_starts_as_a_standby(model_dir):
    config = parse_config({"model_config": {"modelWeightPath": str(model_dir)},
                           "backup_config": {"etcd_endpoints": [f"http://127.0.0.1:{free_port()}"],
                                             "etcd_timeout_s": 0.5, "coordinator_name": "lonely"}})
    app = create_app(config)
    async with TestClient(TestServer(app)) as client:
        assert app[STATE].cluster.role is Role.STANDBY
        models = await client.get("/v1/models")
        assert models.status == 503 and models.headers["Retry-After"] == "1"
        health = await client.get("/health")
        body = await health.json()
        assert health.status == 503 and body["role"] == "standby" and body["coordinator"] == "lonely"
        assert body["etcd"]["reachable"] is False and "ConnectionFailedError" in body["etcd"]["error"]
        live = await client.get("/health/live")
        assert live.status == 200 and await live.json() == {"status": "alive"}


def test_the_health_body_with_etcd_matches_the_openapi_document():
    import jsonschema

    from coordinator.apis.openapi import build_document
    from coordinator.apis.operations import health_body
    from coordinator.http.routes import PREDICT_ROUTES

    document = build_document(PREDICT_ROUTES)
    schema = jsonschema.Draft202012Validator({"$ref": "#/components/schemas/Health",
                                              "components": document["components"]})
    instances = {"prefill": [{"address": "a:1", "state": "healthy"}], "decode": []}
    for etcd in ({"reachable": True, "since": None, "error": "", "endpoints": ["http://e:2379"]},
                 {"reachable": False, "since": 1.5, "error": "refused", "endpoints": ["http://e:2379"]}):
        schema.validate(health_body(instances, {"role": "standby", "coordinator": "A", "leader": "", "etcd": etcd})[1])
    schema.validate(health_body(instances)[1])
    live = document["paths"]["/health/live"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    jsonschema.Draft202012Validator({**live, "components": document["components"]}).validate({"status": "alive"})


async def test_a_node_starts_and_syncs_on_after_a_first_round_that_failed():
    from coordinator.cluster.leadership import Leadership
    from coordinator.cluster.node import ClusterNode
    from coordinator.cluster.registry_sync import RegistrySync
    from coordinator.cluster.shared_health import SharedHealth
    from coordinator.workers.instances import InstanceRegistry
    from tests.coordinator.cluster.fake_store import FakeStore
    from tests.helpers import wait_until

    store, registry = FakeStore(), InstanceRegistry()
    sync = RegistrySync(store, registry, "/p", 3)
    node = ClusterNode(store, Leadership(store, "/p/leader", "A", 3), sync,
                       SharedHealth(store, registry, "/p", "A", sync.lease_of), monitor=None, interval_s=0.02)
    store.failures = [ValueError("a reply that is not JSON")]  # the first read of the registry
    await node.start()
    try:
        assert node.role is Role.ACTIVE
        reads = store.calls.count("get_prefix")
        await wait_until(lambda: store.calls.count("get_prefix") > reads, what="the rounds to go on reading")
    finally:
        await node.stop()
    assert "/p/leader" not in store.data
