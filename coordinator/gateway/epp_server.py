"""The Endpoint Picker's gRPC server: Envoy's ext_proc service plus grpc.health.v1 for probes and Envoy's checks."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from coordinator.gateway.ext_proc import SERVICE as EXT_PROC_SERVICE, ExternalProcessorServicer, ext_proc_handler
from security.tls import LinkTls
READINESS = "readiness"  # the health name a readiness probe asks
_OPTIONS = [
    # Envoy holds one stream per request open for the request's whole life; keepalive pings find dead ones.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
]


class EppServer:
    """Serves one ExternalProcessor servicer on host:port (port 0 picks one), in TLS when `tls` is given.

    Health: "" (liveness) is SERVING while the server runs; READINESS and the ext_proc service follow `ready`."""

    def __init__(self, servicer: ExternalProcessorServicer, host: str = "127.0.0.1", port: int = 0,
                 tls: LinkTls | None = None, *, ready: bool = True):
        self._servicer = servicer
        self.host = host
        self.port = port
        self._tls = tls
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._ready = ready

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> int:
        """Bind and serve; returns the bound port (also `self.port`)."""
        server = grpc.aio.server(options=_OPTIONS)
        server.add_generic_rpc_handlers((ext_proc_handler(self._servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        target = f"{self.host}:{self.port}"
        try:
            if self._tls is None:
                bound = server.add_insecure_port(target)
            else:
                bound = server.add_secure_port(target, self._tls.grpc_server_credentials())
        except RuntimeError:  # grpc's "Failed to bind": say where
            bound = 0
        if bound == 0:
            raise OSError(f"the endpoint picker cannot listen on {target}")
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.set_ready(self._ready)
        await server.start()
        self._server, self.port = server, bound
        return bound

    async def set_ready(self, ready: bool) -> None:
        self._ready = ready
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in (READINESS, EXT_PROC_SERVICE):
            await self._health.set(name, status)

    async def stop(self, grace: float | None = None) -> None:
        """Stop taking streams; those open get `grace` seconds to finish (None: cancelled at once)."""
        if self._server is None:
            return
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace)
        self._server = None
