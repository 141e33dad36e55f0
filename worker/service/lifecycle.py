"""A worker process's life around its gRPC server, whatever its backend: listen, announce, register with
the coordinator; on SIGTERM (or a role switch, `role_switch.py`) deregister, drain, stop."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc

from security.reload import ReloadOnSighup
from worker.metrics import ProcessMetrics
from worker.service.drain import DrainGate
from worker.service.role_switch import RoleSwitch
from worker.service.standard_health import StandardHealth
from worker.service.trust import WorkerTrust

logger = logging.getLogger(__name__)


class ProcessPorts:
    """What outlives a role switch: the metrics endpoint and the ports bound in the first round."""

    def __init__(self):
        self.metrics = ProcessMetrics()
        self.metrics_url: str | None = None
        self.health_port: int | None = None
        self.grpc_port: int | None = None


async def serve_until_stopped(server: grpc.aio.Server, options, gate: DrainGate, health: StandardHealth,
                              closers: list, engine, trust: WorkerTrust, switch: RoleSwitch,
                              ports: ProcessPorts) -> None:
    """Run `server` until SIGTERM/SIGINT or a role switch (`switch.next_role`), then drain for up to
    `options.drain_seconds` (a switch's own drain) and stop; `health` (the grpc.health.v1 state) says SERVING
    from start-up (with a coordinator to register with: from its first accepted registration) to the signal.

    `options` is the process's WorkerOptions; SIGHUP re-reads `trust`'s certificates and secrets."""
    listen = f"{options.host}:{ports.grpc_port or options.port}"
    if trust.grpc_server is not None:
        port = server.add_secure_port(listen, trust.grpc_server.grpc_server_credentials())
    else:
        port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {options.host}:{options.port}")
    await server.start()
    ports.grpc_port = port  # a switched worker keeps its address
    if options.metrics_port >= 0 and ports.metrics_url is None:  # one endpoint for the process's life
        ports.metrics_url = f"http://{options.public_host}:{ports.metrics.serve(options.host, options.metrics_port)}"
        print(f"pdserve worker metrics: {ports.metrics_url}", flush=True)
    if options.health_port >= 0:
        ports.health_port = await health.start_probe_port(options.host, ports.health_port or options.health_port)
        closers.append(health.stop)
        print(f"pdserve worker health: {options.public_host}:{ports.health_port}", flush=True)

    stop = switch.stop
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        # The first signal drains; a second one (an impatient operator) stops waiting for requests.
        if stop.is_set():
            gate.abandon()
        switch.next_role = None  # a signal stops the worker, even mid-switch
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    reloads = ReloadOnSighup()
    reloads.add_all(trust.parts())
    reloads.install()
    # One parseable line on stdout: launchers and tests read the bound port from it.
    print(f"pdserve worker ready: role={options.role} address={options.host}:{port}", flush=True)
    registration = None
    if options.coordinator_url:
        from worker.service.registration import CoordinatorRegistration  # aiohttp: only paid when registering

        registration = CoordinatorRegistration(options.coordinator_url, options.role, f"{options.public_host}:{port}",
                                               ports.metrics_url or "", options.heartbeat_interval_s,
                                               trust.registration, trust.registration_token)
        await registration.start()
    # Probes (a Kubernetes readiness gate, a rollout's next step) see SERVING only once the coordinator can route
    # here: with a coordinator to register with, after its first registration was accepted.
    serving = asyncio.create_task(_serving_once_registered(health, registration))

    await stop.wait()
    serving.cancel()
    await health.draining()  # probes see it at once, before deregistering (a network call) and the drain
    logger.info("draining %s worker on port %d: %d requests in flight", options.role, port, gate.in_flight)
    if registration is not None:
        await registration.stop()  # deregisters, so the coordinator routes nothing more here
    switch.deregistered.set()
    gate.start_draining()
    drain_s = options.drain_seconds if switch.next_role is None else switch.drain_timeout_s
    if not await gate.wait_idle(drain_s):
        logger.warning("%d requests still in flight after draining; stopping anyway", gate.in_flight)
    await server.stop(grace=1)
    for close in closers:
        await close()
    engine.shutdown()
    if engine.pool.tier is not None:
        engine.pool.tier.close()  # its file goes with the worker


async def _serving_once_registered(health: StandardHealth, registration) -> None:
    if registration is not None:
        await registration.registered.wait()
    await health.serving()
