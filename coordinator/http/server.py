"""The coordinator process: the predict and management listeners (plain or TLS), SIGHUP reloads, draining."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from coordinator.gateway.epp_server import EppServer
from coordinator.gateway.ext_proc import ExternalProcessorServicer
from coordinator.http.app import create_app, create_management_app
from coordinator.http.auth import API_KEYS
from coordinator.config import CoordinatorConfig, HttpConfig
from coordinator.http.error_response import error_body_at
from coordinator.errors import ApiError
from coordinator.http.route_table import ROUTE_TABLE, RouteTable
from coordinator.state import STATE
from coordinator.http.tls_site import TlsSite, request_path
from coordinator.http.trust import TRUST
from security.reload import ReloadOnSighup
from security.tls import LinkTls
from telemetry import tracing

logger = logging.getLogger(__name__)


def plain_http_reply(app: web.Application):
    """The bytes answering a plain-HTTP request on a TLS port: a 400 in the error format of the path's API."""
    def reply(path: str) -> bytes:
        error = ApiError(400, "this port speaks TLS: call it with https://")
        body = json.dumps(error_body_at(app[ROUTE_TABLE], path, error)).encode()
        head = (f"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                f"Connection: close\r\n\r\n")
        return head.encode() + body
    return reply


class _ApiErrorRequestHandler(RequestHandler):
    """aiohttp's own refusals (a header line too long, too many headers, a malformed request line) in the
    path's API error format, logged at debug: a client's bad bytes are not the server's error, and must
    not flood the log."""

    route_table: RouteTable
    _head = b""

    def data_received(self, data: bytes) -> None:
        if data[:1].isupper():  # most likely a request line: kept to tell which API a malformed head was for
            self._head = data[:1024]
        super().data_received(data)

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None):
        if not 400 <= status < 500 or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        logger.debug("refused a malformed HTTP request: %s", exc)
        path = request_path(self._head)  # aiohttp's request for an unparsable head has no path of its own
        reason = getattr(exc, "message", None) or message or "malformed HTTP request"
        body = error_body_at(self.route_table, path, ApiError(status, f"bad HTTP request: {reason}"))
        response = web.json_response(body, status=status)
        response.force_close()
        return response


class _ApiErrorServer(web.Server):
    route_table: RouteTable

    def __call__(self) -> RequestHandler:
        handler = _ApiErrorRequestHandler(self, loop=self._loop, **self._kwargs)
        handler.route_table = self.route_table
        return handler


def _answer_protocol_errors_in_api_format(runner: web.AppRunner, app: web.Application) -> None:
    """Make the runner's connections use _ApiErrorRequestHandler (aiohttp has no setting for the handler class)."""
    runner.server.__class__ = _ApiErrorServer
    runner.server.route_table = app[ROUTE_TABLE]


async def _listen(runner: web.AppRunner, app: web.Application, host: str, port: int, tls: LinkTls | None,
                  http: HttpConfig) -> tuple[web.BaseSite, str]:
    """Start a site for `runner`; return it and its URL."""
    if tls is None:
        site = web.TCPSite(runner, host, port)
        scheme = "http"
    else:
        site = TlsSite(runner, host, port, tls, plain_http_reply(app), http.tls_handshake_timeout_s)
        scheme = "https"
    await site.start()
    return site, f"{scheme}://{host}:{site._server.sockets[0].getsockname()[1]}"


async def run_coordinator(config: CoordinatorConfig) -> None:
    """Serve until SIGTERM/SIGINT; print one ready line with the bound address."""
    tracing.configure_from_env("pdserve-coordinator")
    try:
        await _serve(config)
    finally:
        tracing.shutdown()  # the last requests' spans are exported, not lost


# Objects made before the cyclic collector runs over the young ones: each request makes hundreds of containers,
# nearly all freed by reference counting, so the default (700) paid a young collection every few requests.
YOUNG_COLLECTION_AFTER = 20_000


def settle_heap() -> None:
    """Once start-up is done: what it built (the tokenizer, schemas, routes) lives as long as the process, so it
    is frozen out of the collector's reach (a full collection walks only what requests made), and young
    collections run less often (docs/benchmarks/coordinator.md: less CPU per request, and a lower TTFT p99
    without the pauses of full collections over the start-up heap)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_AFTER, *gc.get_threshold()[1:])


async def _serve(config: CoordinatorConfig) -> None:
    app = create_app(config)
    trust = app[TRUST]
    http = config.http_config
    # keepalive_timeout also bounds a client that trickles its request headers: aiohttp closes a
    # connection still waiting for a complete request when it runs out.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, keepalive_timeout=http.keepalive_timeout_s,
                           shutdown_timeout=http.drain_seconds)
    await runner.setup()
    _answer_protocol_errors_in_api_format(runner, app)
    settle_heap()  # before any request: nothing of one is frozen with the start-up heap
    # On shutdown the site stops accepting at once and gives running requests drain_seconds to finish.
    _, predict_url = await _listen(runner, app, http.predict_ip, http.predict_port, trust.predict_tls, http)
    manage_app = create_management_app(app)
    manage_runner = web.AppRunner(manage_app, access_log=None, keepalive_timeout=http.keepalive_timeout_s)
    await manage_runner.setup()
    _answer_protocol_errors_in_api_format(manage_runner, manage_app)
    _, manage_url = await _listen(manage_runner, manage_app, http.manage_ip, http.manage_port, trust.management_tls,
                                  http)

    epp = await _start_endpoint_picker(app, config) if app[STATE].picker is not None else None

    reloads = ReloadOnSighup()
    reloads.add_all(trust.parts())
    if app[API_KEYS] is not None:
        reloads.add("auth_config.api_keys_file", app[API_KEYS].reload)
    reloads.install()
    print(f"pdserve coordinator management: {manage_url}", flush=True)
    print(f"pdserve coordinator ready: {predict_url}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.warning("coordinator draining: no new requests, up to %ss for running ones", http.drain_seconds)
    if epp is not None:  # the gateway's health checks see it going; its open streams end with their requests
        await epp.set_ready(False)
    cluster = app[STATE].cluster
    if cluster is not None:
        await cluster.step_down()  # a standby takes over now, not when this one's lease would have expired
    await manage_runner.cleanup()
    await runner.cleanup()
    if epp is not None:
        await epp.stop(1.0)


async def _start_endpoint_picker(app: web.Application, config: CoordinatorConfig) -> EppServer:
    """The ext_proc server over the app's picker, listening; its address printed before the ready line."""
    picker, tls = app[STATE].picker, app[TRUST].epp_tls
    epp = EppServer(ExternalProcessorServicer(picker, on_picked=picker.metrics.pick_time.observe),
                    config.http_config.predict_ip, config.gateway_config.epp_port, tls)
    await epp.start()
    print(f"pdserve endpoint picker: {'grpcs' if tls is not None else 'grpc'}://{epp.address}", flush=True)
    return epp
