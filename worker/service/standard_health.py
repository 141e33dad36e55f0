"""The standard `grpc.health.v1.Health` service of a worker, which Kubernetes' gRPC probes and gRPC-aware load
balancers ask: NOT_SERVING until the worker serves, SERVING while it takes requests, NOT_SERVING from the moment it
starts draining. pdserve's own Health RPC (load, queue, draining) is unchanged beside it."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from proto import worker_pb2 as pb

SERVICES_OF_ROLE = {  # the pdserve services a worker of each role serves, by their full names
    "prefill": ("PrefillService", "KvEvents"),
    "decode": ("DecodeService", "KvReceiver", "KvEvents"),
    "encode": ("EncoderService", "KvEvents"),
}


def service_names(role: str) -> tuple[str, ...]:
    """The names a probe may ask about: "" (the whole server) and each pdserve service of the role."""
    return ("", *(pb.DESCRIPTOR.services_by_name[name].full_name for name in SERVICES_OF_ROLE[role]))


class StandardHealth:
    """One health state, answered on the worker's gRPC server and on its plaintext `--health-port` if it has one."""

    def __init__(self, role: str):
        self.names = service_names(role)
        self.servicer = health.aio.HealthServicer()
        self._probe_server: grpc.aio.Server | None = None

    async def not_serving_yet(self) -> None:
        """Start every name NOT_SERVING (the servicer begins with "" SERVING), before any server starts."""
        for name in self.names:
            await self.servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def add_to(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def start_probe_port(self, host: str, port: int) -> int:
        """Serve only grpc.health.v1, in plaintext, on `host:port` (0 picks a port): Kubernetes' gRPC probes
        speak no TLS, so they cannot ask a worker whose gRPC port has it. Returns the bound port."""
        server = grpc.aio.server()
        self.add_to(server)
        try:
            bound = server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:  # grpc's "Failed to bind": say which flag asked for the port
            bound = 0
        if bound == 0:
            raise OSError(f"cannot listen on {host}:{port} (--health-port)")
        await server.start()
        self._probe_server = server
        return bound

    async def serving(self) -> None:
        for name in self.names:
            await self.servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def draining(self) -> None:
        """NOT_SERVING for good: a draining worker takes no new requests."""
        await self.servicer.enter_graceful_shutdown()

    async def stop(self) -> None:
        if self._probe_server is not None:
            await self._probe_server.stop(grace=None)
