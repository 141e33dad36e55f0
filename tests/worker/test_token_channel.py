"""The token channel: a decode worker's tokens for one coordinator on one connection, against a real simulated
decode worker process, with the coordinator's own WorkerClient (plaintext, a worker secret, mutual TLS)."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

import pytest

from coordinator.failures import WorkerCallError
from coordinator.request import GenerationRequest, SamplingOptions
from coordinator.worker_client import DecodeAccepted, WorkerClient
from security.secrets import SecretFile
from security.settings import TlsLink
from security.tls import LinkTls
from tests.certificates import make_pki
from tests.helpers import start_sim_worker

pytestmark = pytest.mark.system

PROMPT = list(range(1, 10))
SECRET = "the-cluster-worker-secret"


async def generate(client: WorkerClient, address: str, max_tokens: int = 12, seed: int = 7) -> list:
    """A whole local-prefill generation through `client`; returns its tokens."""
    request = GenerationRequest(uuid.uuid4().hex, PROMPT, SamplingOptions(temperature=1.0, seed=seed), max_tokens)
    stream = client.open_decode(address, request, max_tokens, 512, 30, local_prefill=True)
    try:
        assert isinstance(await stream.read(), DecodeAccepted)
        tokens = []
        while (token := await stream.read()) is not None:
            tokens.append(token)
            if token.finish_reason is not None:
                return tokens
        raise AssertionError(f"the stream ended after {len(tokens)} tokens without a final one")
    finally:
        stream.cancel()


async def channel_opens(client: WorkerClient, address: str):
    for _ in range(100):
        channel = client.token_channels.open_channel(address)
        if channel is not None:
            return channel
        await asyncio.sleep(0.05)
    raise AssertionError(f"no token channel to {address} opened")


@pytest.fixture(scope="module")
def decode_worker():
    worker = start_sim_worker("decode", "--metrics-port", "-1")
    yield worker
    assert worker.stop() == 0


def summary(tokens) -> list[tuple]:
    return [(t.token_id, t.text, t.index, t.finish_reason) for t in tokens]


async def test_tokens_after_the_first_request_come_on_the_channel_and_equal_the_stream_path(decode_worker):
    client = WorkerClient()
    try:
        on_stream = await generate(client, decode_worker.address)  # this `accepted` names the listener
        channel = await channel_opens(client, decode_worker.address)
        request_ids = []
        original_attach = channel.attach
        channel.attach = lambda request_id: request_ids.append(request_id) or original_attach(request_id)
        on_channel = await generate(client, decode_worker.address)
        assert len(request_ids) == 1, "the second request did not take its tokens from the channel"
        assert summary(on_channel) == summary(on_stream)
        assert len(on_channel) == 12 and on_channel[-1].finish_reason is not None
        assert not channel.sinks, "a finished request's sink stayed attached"
    finally:
        await client.close()


async def test_many_concurrent_requests_share_one_channel_and_each_gets_its_own_tokens(decode_worker):
    client = WorkerClient()
    try:
        await generate(client, decode_worker.address)
        await channel_opens(client, decode_worker.address)
        alone = {seed: summary(await generate(client, decode_worker.address, 20, seed)) for seed in range(3)}
        together = await asyncio.gather(*(generate(client, decode_worker.address, 20, seed % 3) for seed in range(24)))
        for seed, tokens in enumerate(together):
            assert summary(tokens) == alone[seed % 3]
    finally:
        await client.close()


async def test_a_lost_channel_fails_its_streams_as_a_lost_decode_worker(decode_worker):
    client = WorkerClient()
    try:
        await generate(client, decode_worker.address)
        channel = await channel_opens(client, decode_worker.address)
        request = GenerationRequest(uuid.uuid4().hex, PROMPT, SamplingOptions(temperature=0.0), 5000)
        stream = client.open_decode(decode_worker.address, request, 5000, 8192, 30, local_prefill=True)
        await stream.read()  # accepted
        await stream.read()  # a first token: the request is decoding
        channel.close()
        with pytest.raises(WorkerCallError) as failed:
            while await stream.read() is not None:
                pass
        assert failed.value.failure.code == "UNAVAILABLE" and failed.value.failure.stage == "decode"
        stream.cancel()
        # The worker released the request: nothing runs on it any more, and a new channel opens on demand.
        await generate(client, decode_worker.address)
        await channel_opens(client, decode_worker.address)
        assert len(await generate(client, decode_worker.address)) == 12
    finally:
        await client.close()


@pytest.fixture(scope="module")
def secure_worker(tmp_path_factory):
    """A decode worker with mutual TLS on its gRPC port (and so on its token channel) and a worker secret."""
    tmp = tmp_path_factory.mktemp("secure")
    pki = make_pki(tmp / "pki")
    (tmp / "secret").write_text(SECRET + "\n")
    security = tmp / "security.json"
    security.write_text(json.dumps({"tls_config": {"worker_grpc": pki.link("server")},
                                    "auth_config": {"worker_secret_file": str(tmp / "secret")}}))
    worker = start_sim_worker("decode", "--metrics-port", "-1", "--security-config", str(security))
    yield worker, pki, tmp
    assert worker.stop() == 0


async def test_the_channel_runs_over_mutual_tls_and_needs_the_worker_secret(secure_worker, caplog):
    worker, pki, tmp = secure_worker
    tls = LinkTls("tls_config.worker_grpc", TlsLink(**pki.link("client")), "client")
    good = WorkerClient(tls, SecretFile("auth_config.worker_secret_file", str(tmp / "secret")))
    try:
        first = await generate(good, worker.address)
        listener = (await channel_opens(good, worker.address)).listener_address
        assert summary(await generate(good, worker.address)) == summary(first)
    finally:
        await good.close()

    # A caller with the certificate but a wrong secret: gRPC refuses it, and so does the channel listener.
    (tmp / "wrong").write_text("not-the-worker-secret-at-all\n")
    wrong = WorkerClient(tls, SecretFile("auth_config.worker_secret_file", str(tmp / "wrong")))
    try:
        with pytest.raises(WorkerCallError) as refused:
            await generate(wrong, worker.address)
        assert refused.value.failure.code == "UNAUTHENTICATED"
        with caplog.at_level(logging.WARNING, logger="coordinator.token_channels"):
            wrong.token_channels.learn(worker.address, listener)
            await asyncio.sleep(1.0)
        assert wrong.token_channels.open_channel(worker.address) is None
        assert "refused the token channel: missing or wrong worker secret" in caplog.text
    finally:
        await wrong.close()
