"""Both KV paths over mutual TLS: bit-exact, and a sender without a certificate of the cluster CA is refused."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from kv_transfer.base import KvTransferError
from kv_transfer.grpc_transport import GRPC_OPTIONS, GrpcKvSender, KvReceiverServicer
from kv_transfer.sink import KvSink
from kv_transfer.tcp_transport import TcpKvReceiver, TcpKvSender
from kv_transfer.transfer_tokens import KvTransferTokens
from proto import worker_pb2_grpc as pb_grpc
from security.settings import TlsLink
from security.tls import LinkTls
from tests.certificates import make_pki
from tests.helpers import bits, make_kv


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def tls(pki, leaf: str, side: str) -> LinkTls:
    return LinkTls("tls_config.kv_transfer", TlsLink(**pki.link(leaf)), side)


class Receiver:
    """A decode side: a sink with tokens, the kv it received, the failures it reported."""

    def __init__(self):
        self.received, self.failures, self.tokens = [], [], KvTransferTokens()
        self.sink = KvSink(self.received.append, lambda rid, msg: self.failures.append((rid, msg)), self.tokens)

    def kv(self):
        kv = make_kv(torch.float16, layers=3, seq=200)
        return dataclasses.replace(kv, transfer_token=self.tokens.issue(kv.request_id))

    def assert_exact(self, kv) -> None:
        (out,) = self.received
        for (k0, v0), (k1, v1) in zip(kv.layers, out.layers):
            assert torch.equal(bits(k0), bits(k1)) and torch.equal(bits(v0), bits(v1))


async def test_raw_tcp_kv_over_mutual_tls_arrives_bit_exact_and_strangers_are_refused(pki):
    rx = Receiver()
    receiver = TcpKvReceiver(rx.sink, timeout_s=5, tls=tls(pki, "server", "server"))
    address = f"127.0.0.1:{await receiver.start('127.0.0.1', 0)}"
    try:
        for sender in (TcpKvSender(chunk_bytes=1 << 16), TcpKvSender(tls=tls(pki, "other-ca-client", "client"))):
            with pytest.raises(KvTransferError):
                await sender.send(address, rx.kv())
        assert rx.received == [] and rx.failures == []
        kv = rx.kv()
        assert await TcpKvSender(chunk_bytes=1 << 16, tls=tls(pki, "client", "client")).send(address, kv) == kv.num_bytes
        rx.assert_exact(kv)
    finally:
        await receiver.stop()


async def test_grpc_push_kv_over_mutual_tls_arrives_bit_exact_and_strangers_are_refused(pki):
    rx = Receiver()
    server = grpc.aio.server(options=GRPC_OPTIONS)
    pb_grpc.add_KvReceiverServicer_to_server(KvReceiverServicer(rx.sink), server)
    port = server.add_secure_port("127.0.0.1:0", tls(pki, "server", "server").grpc_server_credentials())
    await server.start()
    address = f"127.0.0.1:{port}"
    try:
        stranger = GrpcKvSender(timeout_s=5, tls=tls(pki, "other-ca-client", "client"))
        with pytest.raises(KvTransferError):
            await stranger.send(address, rx.kv())
        await stranger.close()
        assert rx.received == [] and rx.failures == []
        sender = GrpcKvSender(timeout_s=5, tls=tls(pki, "client", "client"))
        kv = rx.kv()
        assert await sender.send(address, kv) == kv.num_bytes
        await sender.close()
        rx.assert_exact(kv)
    finally:
        await server.stop(None)


async def test_a_second_tls_transfer_to_the_same_receiver_resumes_the_session(pki):
    rx = Receiver()
    receiver = TcpKvReceiver(rx.sink, timeout_s=5, tls=tls(pki, "server", "server"))
    address = f"127.0.0.1:{await receiver.start('127.0.0.1', 0)}"
    sender = TcpKvSender(tls=tls(pki, "client", "client"))
    try:
        for _ in range(3):
            await sender.send(address, rx.kv())
        assert len(rx.received) == 3 and sender.resumed == 2
    finally:
        await receiver.stop()
