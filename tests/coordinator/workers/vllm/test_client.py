"""VllmClient against an in-process HTTP server answering as vLLM does: the handshake, vLLM's failures as the
codes failures.py classifies, and a lost instance's calls failed at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from coordinator.requests.failures import FailureKind, WorkerCallError
from coordinator.requests.request import GenerationRequest, SamplingOptions
from coordinator.workers.vllm.client import VllmClient
from coordinator.workers.client import DecodeAccepted
from tests.helpers import wait_until

PARAMS = {"remote_engine_id": "e1", "remote_block_ids": [[1]], "remote_host": "127.0.0.1", "remote_port": 5600}


def chunk(token_ids, text, finish=None) -> bytes:
    body = {"choices": [{"index": 0, "text": text, "token_ids": token_ids, "finish_reason": finish,
                         "stop_reason": None}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class FakeVllm:
    """What the tests see of vLLM: the bodies it got, and the answers they script."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.prefill_answer: tuple[int, dict] = (200, {"choices": [{"token_ids": [7]}], "kv_transfer_params": PARAMS})
        self.decode_chunks: list[bytes] = [chunk([7], "a"), chunk([8, 9], "bc", "length"), b"data: [DONE]\n\n"]
        self.hold = asyncio.Event()  # the stream waits on it after its first chunk when `holding`
        self.holding = False

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if not body["stream"]:
            status, answer = self.prefill_answer
            return web.json_response(answer, status=status)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, part in enumerate(self.decode_chunks):
            await response.write(part)
            if i == 0 and self.holding:
                await self.hold.wait()
        return response


@pytest.fixture
async def vllm():
    fake = FakeVllm()
    app = web.Application()
    app.router.add_post("/v1/completions", fake.completions)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    fake.address = f"127.0.0.1:{server.port}"
    yield fake
    fake.hold.set()
    await server.close()


@pytest.fixture
async def client(vllm):
    made = VllmClient({vllm.address: f"http://{vllm.address}"})
    yield made
    await made.close()


def request(request_id: str = "r1") -> GenerationRequest:
    return GenerationRequest(request_id, [1, 2, 3], SamplingOptions())


async def read_all(stream) -> list:
    events = []
    while (event := await stream.read()) is not None:
        events.append(event)
    return events


@contextlib.asynccontextmanager
async def client_of(app: web.Application, **server_args):
    """(address, VllmClient) of a test server running `app`; both closed after."""
    server = TestServer(app, host="127.0.0.1")
    await server.start_server(**server_args)
    address = f"127.0.0.1:{server.port}"
    made = VllmClient({address: f"http://{address}"})
    try:
        yield address, made
    finally:
        await made.close()
        await server.close()


async def streams_in_turn(made: VllmClient, address: str, count: int, max_tokens: int, settled, what: str) -> list:
    """`count` local-prefill streams one after the other, each read whole and left, `settled()` waited for after
    each; their token ids."""
    tokens = []
    for i in range(count):
        stream = made.open_decode(address, request(f"r{i}"), max_tokens, 64, timeout=10, local_prefill=True)
        await stream.read()
        tokens.append([e.token_id for e in await read_all(stream)])
        stream.cancel()
        await wait_until(settled, what=what)
    return tokens


async def test_the_decode_instance_gets_the_prefills_kv_transfer_params_and_streams_every_token(vllm, client):
    stream = client.open_decode(vllm.address, request(), 3, 64, timeout=10)
    assert isinstance(await stream.read(), DecodeAccepted)
    prefill = asyncio.create_task(client.prefill(vllm.address, request(), 3, vllm.address, timeout=10))
    events = await read_all(stream)
    assert (await prefill).first_token_id == 7
    assert [(e.index, e.token_id, e.text) for e in events] == [(0, 7, "a"), (1, 8, ""), (2, 9, "bc")]
    first, second = vllm.bodies
    assert first["max_tokens"] == 1 and first["kv_transfer_params"]["do_remote_decode"] is True
    assert second["kv_transfer_params"] == PARAMS and second["prompt"] == [1, 2, 3]


async def test_a_local_prefill_sends_the_request_alone(vllm, client):
    stream = client.open_decode(vllm.address, request(), 3, 64, timeout=10, local_prefill=True)
    await stream.read()
    assert len(await read_all(stream)) == 3
    assert "kv_transfer_params" not in vllm.bodies[0]


@pytest.mark.parametrize("status, code, kind", [
    (400, "INVALID_ARGUMENT", FailureKind.REQUEST_FAULT),
    (503, "UNAVAILABLE", FailureKind.WORKER_GONE),
    (500, "INTERNAL", FailureKind.WORKER_GONE),
])
async def test_a_failed_prefill_fails_the_decode_waiting_on_it_with_the_same_failure(vllm, client, status, code, kind):
    vllm.prefill_answer = (status, {"error": {"message": "temperature must be in [0, 2]"}})
    stream = client.open_decode(vllm.address, request(), 3, 64, timeout=10)
    await stream.read()
    with pytest.raises(WorkerCallError) as prefill_error:
        await client.prefill(vllm.address, request(), 3, vllm.address, timeout=10)
    with pytest.raises(WorkerCallError) as decode_error:
        await stream.read()
    failure = prefill_error.value.failure
    assert (failure.stage, failure.code, failure.kind) == ("prefill", code, kind)
    assert "temperature must be in [0, 2]" in failure.details
    assert decode_error.value is prefill_error.value


async def test_a_producer_without_kv_transfer_params_is_named(vllm, client):
    vllm.prefill_answer = (200, {"choices": [{"token_ids": [7]}]})
    with pytest.raises(WorkerCallError, match="kv_producer"):
        await client.prefill(vllm.address, request(), 3, vllm.address, timeout=10)


async def test_an_instance_declared_lost_fails_its_stream_at_once(vllm, client):
    vllm.holding = True
    stream = client.open_decode(vllm.address, request(), 3, 64, timeout=30, local_prefill=True)
    await stream.read()
    assert (await stream.read()).token_id == 7
    reading = asyncio.create_task(stream.read())
    await wait_until(lambda: client.pool.busy(vllm.address), what="the stream's connection to be busy")
    await client.lose(vllm.address, "worker lost: silent")
    with pytest.raises(WorkerCallError) as lost:
        await reading
    assert (lost.value.failure.code, lost.value.failure.details) == ("UNAVAILABLE", "worker lost: silent")


async def test_no_listener_is_unavailable_and_a_slow_stream_hits_its_deadline(vllm, client):
    gone = VllmClient({"127.0.0.1:9": "http://127.0.0.1:9"})
    try:
        with pytest.raises(WorkerCallError) as refused:
            await gone.health("127.0.0.1:9", "decode", timeout=5)
        assert refused.value.failure.kind is FailureKind.WORKER_GONE
    finally:
        await gone.close()
    vllm.holding = True
    stream = client.open_decode(vllm.address, request(), 3, 64, timeout=0.5, local_prefill=True)
    await stream.read()
    await stream.read()
    with pytest.raises(WorkerCallError) as late:
        await stream.read()
    assert late.value.failure.code == "DEADLINE_EXCEEDED"
    assert late.value.failure.kind is FailureKind.DEADLINE


async def test_a_stream_cut_inside_an_event_ends_without_a_final_token(vllm, client):
    vllm.decode_chunks = [chunk([7], "a"), b'data: {"choices": [{"ind']
    stream = client.open_decode(vllm.address, request(), 3, 64, timeout=10, local_prefill=True)
    await stream.read()
    assert [e.token_id for e in await read_all(stream)] == [7]


@pytest.mark.parametrize("code, kind", [(500, FailureKind.KV_NOT_RECEIVED), (400, FailureKind.REQUEST_FAULT)])
async def test_an_error_vllm_streams_after_its_200_is_a_failure_that_names_it(vllm, client, code, kind):
    vllm.decode_chunks = [chunk([7], "a"), b'data: {"error": {"message": "KV load failed", "code": %d}}\n\n' % code,
                          b"data: [DONE]\n\n"]
    stream = client.open_decode(vllm.address, request(), 3, 64, timeout=10, local_prefill=True)
    await stream.read()
    await stream.read()
    with pytest.raises(WorkerCallError, match="KV load failed") as failed:
        await stream.read()
    assert failed.value.failure.kind is kind


async def test_requests_in_turn_reuse_one_kept_alive_connection(vllm, client):
    for i in range(5):
        stream = client.open_decode(vllm.address, request(f"r{i}"), 3, 64, timeout=10)
        await stream.read()
        prefill = asyncio.create_task(client.prefill(vllm.address, request(f"r{i}"), 3, vllm.address, timeout=10))
        assert len(await read_all(stream)) == 3
        await prefill
        stream.cancel()
        await wait_until(lambda: not client.pool.busy(vllm.address), what="the stream's connection back in the pool")
    # the prefill's and the decode's: one each while both are open, every later request on them
    assert client.connections_dialled <= 2


async def test_tokens_go_to_the_listener_inside_the_read_and_the_last_through_read(vllm, client):
    vllm.decode_chunks = [chunk([7], "a"), chunk([8], "b"), chunk([9], "c", "length"), b"data: [DONE]\n\n"]
    vllm.holding = True
    stream = client.open_decode(vllm.address, request(), 3, 64, timeout=10, local_prefill=True)
    await stream.read()
    assert (await stream.read()).token_id == 7  # the first through read, as the attempt reads it
    taken, flushes = [], []
    stream.deliver_directly(lambda token: token.finish_reason == 0 and taken.append(token) is None,
                            lambda: flushes.append(len(taken)))
    vllm.hold.set()
    last = await stream.read()
    assert [t.token_id for t in taken] == [8] and flushes and flushes[-1] == 1
    assert (last.token_id, last.finish_reason != 0) == (9, True)
    assert await stream.read() is None


async def test_a_connection_the_instance_closed_while_idle_is_not_reused():
    fake = FakeVllm()
    app = web.Application()
    app.router.add_post("/v1/completions", fake.completions)
    async with client_of(app, keepalive_timeout=0.05) as (address, made):
        streams = await streams_in_turn(made, address, 2, 3, lambda: made.pool.idle(address) == 0,
                                        "the server to close the idle connection")
        assert [len(tokens) for tokens in streams] == [3, 3]
        assert made.connections_dialled == 2


async def test_a_silence_probe_asks_health_alone_and_the_health_check_reads_the_load():
    asked: list[str] = []
    app = web.Application()

    async def answer(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.Response(text='vllm:num_requests_running{engine="0"} 3.0\n')

    app.router.add_get("/health", answer)
    app.router.add_get("/metrics", answer)
    async with client_of(app) as (address, made):
        await made.probe(address, "decode", timeout=5)
        assert asked == ["/health"]
        report = await made.health(address, "decode", timeout=5)
        assert asked == ["/health", "/health", "/metrics"] and report.load.num_running == 3
        made.read_load = False  # a policy that does not route on load: /metrics is not read
        made._loads.clear()
        report = await made.health(address, "decode", timeout=5)
        assert asked == ["/health", "/health", "/metrics", "/health"] and report.load is None


def sse_answer(token_ids: list[int]) -> bytes:
    body = b"".join(chunk([t], f"t{t}", "length" if t == token_ids[-1] else None) for t in token_ids)
    body += b"data: [DONE]\n\n"
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)


async def test_a_request_on_a_kept_alive_connection_closed_under_it_is_sent_once_more_and_streams_whole():
    received: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                received.append(len(received))
                if len(received) == 2:  # the server closes a kept-alive connection as the next request arrives
                    writer.transport.abort()
                    return
                writer.write(sse_answer([7, 8]))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    made = VllmClient({address: f"http://{address}"})
    try:
        streams = await streams_in_turn(made, address, 2, 2, lambda: made.pool.idle(address) == 1,
                                        "the connection back in the pool")
        assert streams == [[7, 8], [7, 8]]
        assert len(received) == 3 and made.connections_dialled == 2
    finally:
        await made.close()
        server.close()


async def test_a_dial_that_outlasts_the_call_fails_at_the_calls_deadline():
    # A listener whose accept queue is full: the kernel drops further SYNs, so a connect hangs (a host gone).
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        try:
            filler.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(filler)
    address = f"127.0.0.1:{port}"
    made = VllmClient({address: f"http://{address}"})
    try:
        with pytest.raises(WorkerCallError) as probe:
            await made.probe(address, "decode", timeout=0.3)
        stream = made.open_decode(address, request(), 2, 64, timeout=0.3, local_prefill=True)
        await stream.read()
        with pytest.raises(WorkerCallError) as decode:
            await stream.read()
        assert probe.value.failure.code == decode.value.failure.code == "DEADLINE_EXCEEDED"
    finally:
        await made.close()
        for s in fillers + [listener]:
            s.close()
