"""An OTLP/HTTP trace collector in the test process: an aiohttp server on a free 127.0.0.1 port that takes
`POST /v1/traces` with a binary protobuf ExportTraceServiceRequest, as a collector's 4318 port does."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb

from tests.otlp_collector import CollectedSpans

PROTOBUF = "application/x-protobuf"
TRACES_PATH = "/v1/traces"  # the specification's path for traces, under a base OTEL_EXPORTER_OTLP_ENDPOINT


class OtlpHttpCollector(CollectedSpans):
    """OTLP over http/protobuf at `path`; any other path is a 404, so a wrong endpoint loses spans visibly.
    `paths` lists the path of every export received."""

    def __init__(self, path: str = TRACES_PATH):
        super().__init__()
        self.path = path
        self.paths: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runner, self.port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)

    async def _start(self) -> tuple[web.AppRunner, int]:
        app = web.Application()
        app.router.add_post(self.path, self._export)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner, runner.addresses[0][1]

    async def _export(self, request: web.Request) -> web.Response:
        self.paths.append(request.path)
        if request.content_type != PROTOBUF:
            return web.Response(status=415, text=f"OTLP/HTTP here takes {PROTOBUF}, not {request.content_type}")
        message = tpb.ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        self.keep(message)
        return web.Response(body=tpb.ExportTraceServiceResponse().SerializeToString(), content_type=PROTOBUF)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The standard OTEL_* settings that make a process export here over http/protobuf, batched every 100 ms."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.base_url, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_BSP_SCHEDULE_DELAY": "100"}

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
