"""Who may call a worker's gRPC port: the worker secret on control calls, no revoked certificate, KV pushes and
the standard grpc.health.v1 service exempt."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from security.grpc_auth import CallerCheck, open_channel, secret_metadata
from security.secrets import SecretFile
from security.settings import TlsLink
from security.tls import LinkTls
from tests.certificates import make_pki


class Decode(pb_grpc.DecodeServiceServicer):
    async def Health(self, request, context):
        return pb.HealthResponse(role="decode")

    async def Decode(self, request, context):
        yield pb.DecodeEvent(accepted=pb.Accepted(kv_transfer_token="t"))


class Kv(pb_grpc.KvReceiverServicer):
    async def PushKv(self, request_iterator, context):
        async for _ in request_iterator:
            pass
        return pb.KvAck(bytes_received=7)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def secret(tmp_path) -> SecretFile:
    path = tmp_path / "secret"
    path.write_text("the-cluster-worker-secret\n")
    return SecretFile("auth_config.worker_secret_file", str(path))


async def serve(check: CallerCheck, tls: LinkTls | None = None):
    server = grpc.aio.server(interceptors=[check])
    pb_grpc.add_DecodeServiceServicer_to_server(Decode(), server)
    pb_grpc.add_KvReceiverServicer_to_server(Kv(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    if tls is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", tls.grpc_server_credentials())
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_control_calls_need_the_secret_and_kv_pushes_do_not(secret, tmp_path):
    server, address = await serve(CallerCheck(secret, None))
    wrong_path = tmp_path / "wrong"
    wrong_path.write_text("not-the-cluster-secret-at-all\n")
    try:
        for caller in (None, SecretFile("k", str(wrong_path))):
            async with open_channel(address, None, []) as channel:
                stub, metadata = pb_grpc.DecodeServiceStub(channel), secret_metadata(caller)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Health(pb.HealthRequest(), metadata=metadata)
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Decode(pb.DecodeRequest(), metadata=metadata).read()
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
                ack = await pb_grpc.KvReceiverStub(channel).PushKv(iter([pb.KvMessage()]), metadata=metadata)
                assert ack.bytes_received == 7  # the one-time transfer token guards KV, not the secret
        async with open_channel(address, None, []) as channel:
            stub, metadata = pb_grpc.DecodeServiceStub(channel), secret_metadata(secret)
            assert (await stub.Health(pb.HealthRequest(), metadata=metadata)).role == "decode"
            assert (await stub.Decode(pb.DecodeRequest(), metadata=metadata).read()).accepted.kv_transfer_token == "t"
    finally:
        await server.stop(None)


async def test_the_standard_health_service_answers_without_the_secret(secret):
    server, address = await serve(CallerCheck(secret, None))
    try:
        async with open_channel(address, None, []) as channel:  # as a Kubernetes gRPC probe: no metadata
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pb_grpc.DecodeServiceStub(channel).Health(pb.HealthRequest())
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(None)


async def test_a_caller_whose_certificate_the_crl_revokes_is_refused_per_call(pki):
    server_tls = LinkTls("tls_config.worker_grpc", TlsLink(**pki.link("server", crl="crl.pem")), "server")
    server, address = await serve(CallerCheck(None, server_tls), server_tls)
    try:
        for leaf, allowed in (("client", True), ("revoked-client", False)):
            client_tls = LinkTls("tls_config.worker_grpc", TlsLink(**pki.link(leaf)), "client")
            async with open_channel(address, client_tls, []) as channel:
                call = pb_grpc.DecodeServiceStub(channel).Health(pb.HealthRequest())
                if allowed:
                    assert (await call).role == "decode"
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await call
                    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
                    assert "revoked" in refused.value.details()
    finally:
        await server.stop(None)
