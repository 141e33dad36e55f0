"""The token channel: a coordinator's decode requests and their events on one connection per decode worker,
against a real simulated decode worker process, with the coordinator's own WorkerClient (plaintext, a worker
secret, mutual TLS): the same tokens and the same failures as a gRPC Decode call."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
import uuid

import pytest

from coordinator.requests.failures import FailureKind, WorkerCallError
from coordinator.requests.request import GenerationRequest, SamplingOptions
from coordinator.workers.client import ChannelDecodeStream, DecodeAccepted, DecodeStream, WorkerClient
from proto import worker_pb2 as pb
from proto.token_channel import RecordToken
from security.secrets import SecretFile
from security.settings import TlsLink
from security.tls import LinkTls
from tests.certificates import make_pki
from tests.helpers import health, start_sim_worker, token_channel_opens, wait_for_idle, wait_until

pytestmark = pytest.mark.system

PROMPT = list(range(1, 10))
SECRET = "the-cluster-worker-secret"


async def generate(client: WorkerClient, address: str, max_tokens: int = 12, seed: int = 7,
                   via: type = ChannelDecodeStream) -> list:
    """A whole local-prefill generation through `client`, taken `via` a channel or a Decode call; its tokens."""
    request = GenerationRequest(uuid.uuid4().hex, PROMPT, SamplingOptions(temperature=1.0, seed=seed), max_tokens)
    stream = client.open_decode(address, request, max_tokens, 512, 30, local_prefill=True)
    assert isinstance(stream, via)
    try:
        assert isinstance(await stream.read(), DecodeAccepted)
        tokens = []
        while (token := await stream.read()) is not None:
            tokens.append(token)
            if token.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                return tokens
        raise AssertionError(f"the stream ended after {len(tokens)} tokens without a final one")
    finally:
        stream.cancel()


@contextlib.asynccontextmanager
async def client_with_channel(address: str):
    """The coordinator's WorkerClient once its channel to `address` is open (a first request, a gRPC call, named it)."""
    client = WorkerClient()
    try:
        await generate(client, address, via=DecodeStream)
        yield client, await token_channel_opens(client, address)
    finally:
        await client.close()


@pytest.fixture(scope="module")
def decode_worker():
    worker = start_sim_worker("decode", "--metrics-port", "-1")
    yield worker
    assert worker.stop() == 0


def summary(tokens) -> list[tuple]:
    return [(t.token_id, t.text, t.index, t.finish_reason, t.matched_stop) for t in tokens]


async def test_requests_after_the_first_go_on_the_channel_and_get_the_tokens_a_decode_call_gets(decode_worker):
    client = WorkerClient()
    try:
        on_stream = await generate(client, decode_worker.address, via=DecodeStream)  # its `accepted` names the listener
        channel = await token_channel_opens(client, decode_worker.address)
        on_channel = await generate(client, decode_worker.address)
        assert summary(on_channel) == summary(on_stream)
        assert [t.batch_size for t in on_channel] == [t.batch_size for t in on_stream] == [1] * 12
        assert len(on_channel) == 12 and on_channel[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        # Mid-stream tokens came as token records, the last one (its finish reason) as a protobuf event.
        assert all(isinstance(t, RecordToken) for t in on_channel[:-1])
        assert isinstance(on_channel[-1], pb.TokenEvent)
        assert not channel.sinks, "a finished request's sink stayed attached"
    finally:
        await client.close()


async def test_many_concurrent_requests_share_one_channel_and_each_gets_its_own_tokens(decode_worker):
    async with client_with_channel(decode_worker.address) as (client, _):
        alone = {seed: summary(await generate(client, decode_worker.address, 20, seed)) for seed in range(3)}
        together = await asyncio.gather(*(generate(client, decode_worker.address, 20, seed % 3) for seed in range(24)))
        for seed, tokens in enumerate(together):
            assert summary(tokens) == alone[seed % 3]


async def long_request(client: WorkerClient, address: str, timeout_s: float = 30):
    request = GenerationRequest(uuid.uuid4().hex, PROMPT, SamplingOptions(temperature=0.0), 5000)
    stream = client.open_decode(address, request, 5000, 8192, timeout_s, local_prefill=True)
    assert isinstance(stream, ChannelDecodeStream)
    assert isinstance(await stream.read(), DecodeAccepted)
    await stream.read()  # a first token: the request is decoding
    return stream


async def read_until_failure(stream) -> WorkerCallError:
    with pytest.raises(WorkerCallError) as failed:
        while True:
            await stream.read()
    return failed.value


async def test_a_lost_channel_fails_its_streams_as_a_lost_decode_worker_and_the_worker_frees_them(decode_worker):
    async with client_with_channel(decode_worker.address) as (client, channel):
        stream = await long_request(client, decode_worker.address)
        channel.close()
        failure = (await read_until_failure(stream)).failure
        assert (failure.code, failure.stage, failure.kind) == ("UNAVAILABLE", "decode", FailureKind.WORKER_GONE)
        stream.cancel()
        await asyncio.to_thread(wait_for_idle, decode_worker.address, "decode")
        # The next request takes a Decode call, whose `accepted` opens a new channel.
        await generate(client, decode_worker.address, via=DecodeStream)
        await token_channel_opens(client, decode_worker.address)
        assert len(await generate(client, decode_worker.address)) == 12


async def test_a_cancelled_channel_request_is_freed_on_the_worker(decode_worker):
    async with client_with_channel(decode_worker.address) as (client, _):
        stream = await long_request(client, decode_worker.address)
        busy = await asyncio.to_thread(health, decode_worker.address, "decode")
        assert busy.num_running == 1 and busy.kv_used_tokens > 0  # the worker runs it
        stream.cancel()
        await asyncio.to_thread(wait_for_idle, decode_worker.address, "decode")


async def test_a_channel_request_past_its_deadline_fails_as_a_decode_call_past_its_deadline(decode_worker):
    async with client_with_channel(decode_worker.address) as (client, _):
        stream = await long_request(client, decode_worker.address, timeout_s=0.5)
        failure = (await read_until_failure(stream)).failure
        assert (failure.code, failure.kind) == ("DEADLINE_EXCEEDED", FailureKind.DEADLINE)
        await asyncio.to_thread(wait_for_idle, decode_worker.address, "decode")


async def test_a_bad_channel_request_gets_the_status_a_decode_call_gets(decode_worker):
    fresh, warm = WorkerClient(), WorkerClient()  # no channel yet / a channel open
    try:
        await generate(warm, decode_worker.address, via=DecodeStream)
        await token_channel_opens(warm, decode_worker.address)
        failures = []
        for client, via in ((fresh, DecodeStream), (warm, ChannelDecodeStream)):
            request = GenerationRequest(uuid.uuid4().hex, PROMPT, SamplingOptions(temperature=0.0), 4)
            stream = client.open_decode(decode_worker.address, request, 4, 5, 30)  # the prompt is over max_seq_len
            assert isinstance(stream, via)
            failures.append((await read_until_failure(stream)).failure)
        assert failures[0].code == failures[1].code == "INVALID_ARGUMENT"
        assert failures[0].details == failures[1].details and "max_seq_len=5" in failures[1].details
    finally:
        await fresh.close()
        await warm.close()


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
        first = await generate(good, worker.address, via=DecodeStream)
        listener = (await token_channel_opens(good, worker.address)).listener_address
        assert summary(await generate(good, worker.address)) == summary(first)
    finally:
        await good.close()

    # A caller with the certificate but a wrong secret: gRPC refuses it, and so does the channel listener.
    (tmp / "wrong").write_text("not-the-worker-secret-at-all\n")
    wrong = WorkerClient(tls, SecretFile("auth_config.worker_secret_file", str(tmp / "wrong")))
    try:
        with pytest.raises(WorkerCallError) as refused:
            await generate(wrong, worker.address, via=DecodeStream)
        assert refused.value.failure.code == "UNAUTHENTICATED"
        with caplog.at_level(logging.WARNING, logger="coordinator.workers.token_channels"):
            wrong.token_channels.learn(worker.address, listener)
            await wait_until(lambda: "refused the token channel" in caplog.text, what="the channel's refusal")
        assert wrong.token_channels.open_channel(worker.address) is None
        assert "refused the token channel: missing or wrong worker secret" in caplog.text
    finally:
        await wrong.close()


async def test_a_frozen_worker_fails_a_channel_request_and_a_health_probe_at_their_deadlines_as_calls_do():
    worker = start_sim_worker("decode", "--metrics-port", "-1")
    try:
        async with client_with_channel(worker.address) as (client, _):
            stream = await long_request(client, worker.address, timeout_s=1.0)
            os.kill(worker.proc.pid, signal.SIGSTOP)  # it can send neither its tokens nor its own deadline error
            try:
                started = time.monotonic()
                failure = (await read_until_failure(stream)).failure
                assert (failure.code, failure.kind) == ("DEADLINE_EXCEEDED", FailureKind.DEADLINE)
                assert time.monotonic() - started < 2.0
                with pytest.raises(WorkerCallError) as probe:  # a health probe on the channel gets no answer either
                    await client.health(worker.address, "decode", timeout=0.5)
                assert (probe.value.failure.stage, probe.value.failure.code) == ("decode", "DEADLINE_EXCEEDED")
            finally:
                os.kill(worker.proc.pid, signal.SIGCONT)
            await asyncio.to_thread(wait_for_idle, worker.address, "decode")  # the cancel reached it after all
    finally:
        assert worker.stop() == 0


async def test_a_health_probe_goes_on_the_channel_and_answers_as_the_health_call(decode_worker):
    by_call = WorkerClient()
    try:
        async with client_with_channel(decode_worker.address) as (client, channel):
            await asyncio.to_thread(wait_for_idle, decode_worker.address, "decode")
            sent = []
            original = channel._send
            channel._send = lambda request: (sent.append(request.WhichOneof("kind")), original(request))
            on_channel = await client.health(decode_worker.address, "decode")
            assert sent == ["health"] and not channel.sinks
            assert on_channel == await by_call.health(decode_worker.address, "decode")
            assert on_channel.load.kv_capacity_tokens > 0 and not on_channel.draining
            channel.answers_health = False  # as a worker from before the `health` kind greets
            assert await client.health(decode_worker.address, "decode") == on_channel  # by a call
            assert sent == ["health"]
    finally:
        await by_call.close()

