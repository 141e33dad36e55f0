"""A real Envoy asking pdserve's Endpoint Picker over ext_proc, routing to small echo sidecars on 127.0.0.1.

Only the picker is a test double (it picks from a list the test sets and records what the gateway reports back);
Envoy, the ext_proc server and the bootstrap are the ones deployed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import socket
from dataclasses import dataclass, field

import aiohttp
import grpc
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.gateway.endpoint_pick import (DESTINATION_HEADER, LB_NAMESPACE, SERVED_KEY, SUBSET_HEADER,
                                               SUBSET_NAMESPACE, EndpointPick, GatewayRequest, PickRefused)
from coordinator.gateway.epp_server import EXT_PROC_SERVICE, READINESS, EppServer
from coordinator.gateway.ext_proc import ExternalProcessorServicer, process_call
from launcher.envoy_gateway import EnvoyProcess, render_bootstrap
from security.settings import TlsLink
from proto import ext_proc_pb2 as ep
from security.tls import LinkTls
from tests.certificates import make_pki
from tests.helpers import wait_until

pytestmark = pytest.mark.system

BODY_MODES = ["streamed", "buffered"]
PROMPT_220KB = json.dumps({"model": "m", "prompt": "word " * 44_000}).encode()
STREAM_CHUNKS = [f"data: {i} {'x' * 20_000}\n\n".encode() for i in range(10)]


@dataclass
class RecordedPick(EndpointPick):
    """A pick that records what the gateway reported about it."""

    served_endpoints: list[str] = field(default_factory=list)
    num_closed: int = 0

    def served(self, endpoint: str) -> None:
        self.served_endpoints.append(endpoint)

    def close(self) -> None:
        self.num_closed += 1


class ListPicker:
    """Picks `endpoints` (or raises `failure`), applying the header and body changes the test sets."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.endpoints: list[str] = []
        self.failure: Exception | None = None
        self.set_headers: dict[str, str] = {}
        self.remove_headers: list[str] = []
        self.body: bytes | None = None
        self.requests: list[GatewayRequest] = []
        self.picks: list[RecordedPick] = []
        self.pick_seconds: list[float] = []
        self.hold: asyncio.Event | None = None  # when set, each pick waits for it

    async def pick(self, request: GatewayRequest) -> EndpointPick:
        self.requests.append(request)
        if self.hold is not None:
            await self.hold.wait()
        if self.failure is not None:
            raise self.failure
        pick = RecordedPick(list(self.endpoints), dict(self.set_headers), list(self.remove_headers), self.body)
        self.picks.append(pick)
        return pick

    async def only_pick_closed(self) -> RecordedPick:
        """The one pick made, once the gateway has ended its stream."""
        await wait_until(lambda: len(self.picks) == 1 and self.picks[0].num_closed, what="the pick's close()")
        return self.picks[0]


@dataclass
class Sidecars:
    addresses: list[str]  # live echo servers, by name sidecar-0, sidecar-1
    dead: str  # a bound port that listens to nothing: connections to it are refused
    release: asyncio.Event  # ends the responses of /hang
    runners: list[web.AppRunner] = field(default_factory=list)

    def name_of(self, address: str) -> str:
        return f"sidecar-{self.addresses.index(address)}"


def echo_app(name: str, release: asyncio.Event) -> web.Application:
    """Answers with what it received; /stream answers STREAM_CHUNKS as a chunked stream, /hang a first line and the
    last once `release` is set."""

    async def hang(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"first\n")
        await release.wait()
        await response.write(b"last\n")
        await response.write_eof()
        return response

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for chunk in STREAM_CHUNKS:
            await response.write(chunk)
        await response.write_eof()
        return response

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({"name": name, "num_bytes": len(body), "sha256": hashlib.sha256(body).hexdigest(),
                                  "headers": {k.lower(): v for k, v in request.headers.items()}})

    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_get("/stream", stream)
    app.router.add_get("/hang", hang)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


def refused_port() -> tuple[socket.socket, str]:
    """A port bound and never listened on (so nothing else takes it while the test runs)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock, f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
async def sidecars():
    runners, addresses, release = [], [], asyncio.Event()
    for i in range(2):
        runner = web.AppRunner(echo_app(f"sidecar-{i}", release), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        addresses.append(f"127.0.0.1:{runner.addresses[0][1]}")
    dead_socket, dead = refused_port()
    yield Sidecars(addresses, dead, release, runners)
    release.set()
    dead_socket.close()
    for runner in runners:
        await runner.cleanup()


@pytest.fixture(scope="module")
def picker():
    return ListPicker()


@pytest.fixture(autouse=True)
def fresh_picker(picker):
    picker.reset()


@pytest.fixture(scope="module")
async def epp(picker):
    server = EppServer(ExternalProcessorServicer(picker, on_picked=lambda s: picker.pick_seconds.append(s)))
    await server.start()
    yield server
    await server.stop(grace=None)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@contextlib.asynccontextmanager
async def running_gateway(directory, epp_address: str, sidecars: Sidecars, with_dead: bool = True, **options):
    """Envoy on a bootstrap rendered for `sidecars` (the dead endpoint included unless not `with_dead`: Envoy's own
    choice, unpicked, may take it on every try); yields its base URL."""
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "envoy.yaml"
    endpoints = [*sidecars.addresses, sidecars.dead] if with_dead else sidecars.addresses
    config.write_text(render_bootstrap(0, epp_address, endpoints, **options))
    envoy = EnvoyProcess(config, concurrency=1)
    envoy.start()
    try:
        await envoy.wait_ready(timeout_s=60)
        yield f"http://127.0.0.1:{envoy.listener_port()}"
    finally:
        envoy.stop()


@pytest.fixture(scope="module", params=BODY_MODES)
async def gateway(request, epp, sidecars, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"envoy-{request.param}")
    async with running_gateway(directory, epp.address, sidecars, body_mode=request.param) as url:
        yield url


@pytest.fixture
async def client():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def post(client, url: str, body: bytes, headers: dict | None = None) -> tuple[aiohttp.ClientResponse, dict]:
    async with client.post(f"{url}/v1/completions", data=body,
                           headers={"content-type": "application/json", **(headers or {})}) as response:
        return response, await response.json(content_type=None)


# Routing by the pick ---------------------------------------------------------------------------------------------

async def test_request_lands_on_the_picked_endpoint_and_served_is_reported(gateway, picker, sidecars, client):
    picker.endpoints = [sidecars.addresses[1], sidecars.addresses[0]]
    body = b'{"model": "m", "prompt": "hello"}'
    response, echoed = await post(client, gateway, body, {SUBSET_HEADER: f"{sidecars.addresses[1]}, 10.0.0.9:80"})
    assert response.status == 200 and echoed["name"] == "sidecar-1"
    assert echoed["sha256"] == hashlib.sha256(body).hexdigest()
    assert echoed["headers"][DESTINATION_HEADER] == ",".join(picker.endpoints)
    assert SERVED_KEY not in response.headers  # the served address stays inside the gateway
    pick = await picker.only_pick_closed()
    assert pick.served_endpoints == [sidecars.addresses[1]]
    (seen,) = picker.requests
    assert seen.body == body and seen.headers[":path"] == "/v1/completions" and seen.headers[":method"] == "POST"
    assert seen.subset == [sidecars.addresses[1], "10.0.0.9:80"]
    assert len(picker.pick_seconds) == 1 and picker.pick_seconds[0] >= 0


async def test_chunked_prompt_of_220_kb_arrives_intact(gateway, picker, sidecars, client):
    async def pieces():
        for i in range(0, len(PROMPT_220KB), 10_000):
            yield PROMPT_220KB[i:i + 10_000]

    picker.endpoints = [sidecars.addresses[0]]
    response, echoed = await post(client, gateway, pieces())
    assert response.status == 200 and echoed["name"] == "sidecar-0"
    assert (echoed["num_bytes"], echoed["sha256"]) == (len(PROMPT_220KB), hashlib.sha256(PROMPT_220KB).hexdigest())
    assert picker.requests[0].body == PROMPT_220KB
    assert (await picker.only_pick_closed()).num_closed == 1


async def test_request_without_body_is_picked_on_its_headers(gateway, picker, sidecars, client):
    picker.endpoints = [sidecars.addresses[1]]
    async with client.get(f"{gateway}/v1/models") as response:
        echoed = await response.json()
    assert response.status == 200 and echoed["name"] == "sidecar-1" and echoed["num_bytes"] == 0
    assert picker.requests[0].body == b"" and picker.requests[0].subset is None
    assert (await picker.only_pick_closed()).served_endpoints == [sidecars.addresses[1]]


async def test_dead_first_endpoint_falls_back_to_the_next_picked(gateway, picker, sidecars, client):
    picker.endpoints = [sidecars.dead, sidecars.addresses[1]]
    response, echoed = await post(client, gateway, PROMPT_220KB)
    assert response.status == 200 and echoed["name"] == "sidecar-1"
    assert echoed["sha256"] == hashlib.sha256(PROMPT_220KB).hexdigest()  # the retry re-sent the whole body
    pick = await picker.only_pick_closed()
    assert pick.served_endpoints == [sidecars.addresses[1]] and pick.num_closed == 1


async def test_pick_header_and_body_changes_reach_the_endpoint(gateway, picker, sidecars, client):
    picker.endpoints = [sidecars.addresses[0]]
    picker.set_headers = {"x-prefiller-host-port": "10.1.2.3:8000"}
    picker.remove_headers = ["x-drop-me"]
    picker.body = json.dumps({"model": "a-much-longer-rewritten-model-name", "prompt": "hi"}).encode()
    response, echoed = await post(client, gateway, b'{"model": "m", "prompt": "hi"}', {"x-drop-me": "1"})
    assert response.status == 200
    assert (echoed["num_bytes"], echoed["sha256"]) == (len(picker.body), hashlib.sha256(picker.body).hexdigest())
    assert echoed["headers"]["x-prefiller-host-port"] == "10.1.2.3:8000" and "x-drop-me" not in echoed["headers"]


async def test_pick_stays_open_until_the_response_ends(gateway, picker, sidecars, client):
    picker.endpoints = [sidecars.addresses[0]]
    sidecars.release.clear()
    async with client.get(f"{gateway}/hang") as response:
        assert await response.content.readline() == b"first\n"
        (streaming,) = await wait_until(lambda: picker.picks if picker.picks[0].served_endpoints else None,
                                        what="the served endpoint")
        # A whole request after it: its stream shares Envoy's one connection to the picker, behind any close of
        # the first.
        async with client.get(f"{gateway}/v1/models") as later:
            assert later.status == 200
        await wait_until(lambda: len(picker.picks) == 2 and picker.picks[1].num_closed, what="the later close")
        assert streaming.num_closed == 0
        sidecars.release.set()
        assert await response.content.read() == b"last\n"
    await wait_until(lambda: streaming.num_closed, what="the close at the response's end")
    assert streaming.num_closed == 1


async def test_pick_is_closed_when_the_client_goes_away_mid_response(gateway, picker, sidecars, client):
    picker.endpoints = [sidecars.addresses[1]]
    sidecars.release.clear()
    response = await client.get(f"{gateway}/hang")
    assert await response.content.readline() == b"first\n"
    response.close()
    assert (await picker.only_pick_closed()).num_closed == 1


async def test_streamed_response_passes_through_a_picker_that_reads_it(epp, picker, sidecars, client, tmp_path):
    picker.endpoints = [sidecars.addresses[1]]
    async with running_gateway(tmp_path, epp.address, sidecars, response_body_mode="streamed") as url:
        async with client.get(f"{url}/stream") as response:
            received = await response.read()
    assert response.status == 200 and received == b"".join(STREAM_CHUNKS)
    assert (await picker.only_pick_closed()).served_endpoints == [sidecars.addresses[1]]


async def test_subset_hint_in_envoy_metadata_reaches_the_picker(epp, picker, sidecars):
    """Gateways pass the hint as filter metadata, a list (spoken to the picker directly: the bootstrap sets none)."""
    picker.endpoints = [sidecars.addresses[0]]
    request = ep.ProcessingRequest(request_headers=ep.HttpHeaders(
        headers=ep.HeaderMap(headers=[ep.HeaderValue(key=":path", raw_value=b"/v1/models")]),
        end_of_stream=True))
    request.metadata_context.filter_metadata[SUBSET_NAMESPACE].update({SUBSET_HEADER: sidecars.addresses})
    async with grpc.aio.insecure_channel(epp.address) as channel:
        answers = [a async for a in process_call(channel)(iter([request]))]
    assert picker.requests[0].subset == sidecars.addresses
    (answer,) = answers
    assert answer.request_headers.response.header_mutation.set_headers[0].header.raw_value.decode() == \
        sidecars.addresses[0]
    assert answer.dynamic_metadata[LB_NAMESPACE][DESTINATION_HEADER] == sidecars.addresses[0]
    assert (await picker.only_pick_closed()).num_closed == 1


async def test_picker_health_serves_liveness_at_once_and_readiness_when_set(picker):
    server = EppServer(ExternalProcessorServicer(picker), ready=False)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            async def status(name: str) -> int:
                return (await health.Check(health_pb2.HealthCheckRequest(service=name))).status

            serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
            assert [await status(n) for n in ("", EXT_PROC_SERVICE, READINESS)] == [serving, not_serving, not_serving]
            await server.set_ready(True)
            assert [await status(n) for n in ("", EXT_PROC_SERVICE, READINESS)] == [serving, serving, serving]
    finally:
        await server.stop(grace=None)


# Refusals --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("status, headers, error_type", [(503, {}, "service_unavailable"),
                                                         (429, {"retry-after": "7"}, "rate_limit_error")])
async def test_refused_pick_is_answered_by_the_gateway(gateway, picker, client, status, headers, error_type):
    picker.failure = PickRefused(status, "no endpoint can take it", headers)
    response, body = await post(client, gateway, PROMPT_220KB)
    assert response.status == status
    assert body["error"] == {"message": "no endpoint can take it", "type": error_type, "param": None, "code": status}
    assert response.headers.get("retry-after") == headers.get("retry-after")


async def test_picker_crash_is_a_500_that_names_nothing(gateway, picker, client):
    picker.failure = RuntimeError("secret internals at 10.0.0.1")
    response, body = await post(client, gateway, b"{}")
    assert response.status == 500
    assert body["error"]["code"] == 500 and "10.0.0.1" not in json.dumps(body)


# The picker unreachable ------------------------------------------------------------------------------------------

@pytest.fixture
def dead_epp():
    sock, address = refused_port()
    yield address
    sock.close()


async def test_fail_closed_gateway_answers_503_while_the_picker_is_down(dead_epp, sidecars, client, tmp_path):
    async with running_gateway(tmp_path, dead_epp, sidecars, fail_open=False) as url:
        response, _ = await post(client, url, b"{}")
        assert response.status == 503
        async with client.get(f"{url}/v1/models") as response:
            assert response.status == 503


async def test_fail_open_buffered_gateway_serves_unpicked_while_the_picker_is_down(dead_epp, sidecars, client,
                                                                                   tmp_path):
    async with running_gateway(tmp_path, dead_epp, sidecars, False, body_mode="buffered", fail_open=True) as url:
        # A client's own destination header is stripped: only the picker chooses.
        response, echoed = await post(client, url, PROMPT_220KB, {DESTINATION_HEADER: "10.9.9.9:80"})
        assert response.status == 200 and echoed["name"] in ("sidecar-0", "sidecar-1")
        assert echoed["sha256"] == hashlib.sha256(PROMPT_220KB).hexdigest()
        assert DESTINATION_HEADER not in echoed["headers"]


async def test_fail_open_streamed_gateway_serves_bodiless_requests_while_the_picker_is_down(
        dead_epp, sidecars, client, tmp_path):
    async with running_gateway(tmp_path, dead_epp, sidecars, False, body_mode="streamed", fail_open=True) as url:
        async with client.get(f"{url}/v1/models") as response:
            assert response.status == 200 and (await response.json())["name"] in ("sidecar-0", "sidecar-1")


@pytest.mark.parametrize("body_mode, status", [("buffered", 200), ("streamed", 503)])
async def test_fail_open_survives_a_picker_stopped_mid_pick_only_when_envoy_holds_the_body(
        picker, sidecars, client, tmp_path, body_mode, status):
    """Envoy 1.40 fails FULL_DUPLEX_STREAMED open only until a body chunk has gone to the picker: after that it has
    no copy of the body to send on. In BUFFERED mode it has, and the request goes on unpicked."""
    server = EppServer(ExternalProcessorServicer(picker))
    await server.start()
    picker.hold = asyncio.Event()
    try:
        async with running_gateway(tmp_path, server.address, sidecars, False, body_mode=body_mode,
                                   fail_open=True) as url:
            sent = asyncio.ensure_future(post(client, url, PROMPT_220KB))
            await wait_until(lambda: picker.requests, what="the pick to start")
            await server.stop(grace=None)
            response, echoed = await sent
            assert response.status == status
            if status == 200:
                assert echoed["sha256"] == hashlib.sha256(PROMPT_220KB).hexdigest()
    finally:
        picker.hold.set()
        await server.stop(grace=None)


# TLS between Envoy and the picker --------------------------------------------------------------------------------

@pytest.fixture
async def tls_epp(pki, picker):
    tls = LinkTls("gateway.epp", TlsLink(**pki.link("server", mutual=True)), "server")
    server = EppServer(ExternalProcessorServicer(picker), tls=tls)
    await server.start()
    yield server
    await server.stop(grace=None)


async def test_mutual_tls_to_the_picker_routes_and_plaintext_is_refused(tls_epp, pki, picker, sidecars, client,
                                                                        tmp_path):
    picker.endpoints = [sidecars.addresses[0]]
    client_tls = (pki.path("ca.pem"), pki.path("client.pem"), pki.path("client-key.pem"))
    async with running_gateway(tmp_path / "mtls", tls_epp.address, sidecars, epp_tls=client_tls) as url:
        response, echoed = await post(client, url, b'{"prompt": "over tls"}')
        assert response.status == 200 and echoed["name"] == "sidecar-0"
    async with running_gateway(tmp_path / "plain", tls_epp.address, sidecars) as url:
        response, _ = await post(client, url, b'{"prompt": "in the clear"}')
        assert response.status == 503
    no_certificate = (pki.path("ca.pem"), None, None)
    async with running_gateway(tmp_path / "no-cert", tls_epp.address, sidecars, epp_tls=no_certificate) as url:
        response, _ = await post(client, url, b'{"prompt": "no client certificate"}')
        assert response.status == 503
    assert len(picker.requests) == 1
