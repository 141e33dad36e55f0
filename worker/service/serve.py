"""`pdserve worker`: build the chosen backend's engine, wire it to the servicers and KV transports, serve.

The backend is picked like SGLang's KV transports: one set of servicers, engines from
`worker.engine` (torch, imported only when chosen) or `worker.simulated` (no torch).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import replace

import grpc

from kv_transfer.grpc_transport import GRPC_OPTIONS, GrpcKvSender, KvReceiverServicer
from kv_transfer.sink import KvSink
from kv_transfer.tcp_transport import TcpKvReceiver, TcpKvSender
from kv_transfer.transfer_tokens import KvTransferTokens
from proto import worker_pb2_grpc as pb_grpc
from security.grpc_auth import CallerCheck
from telemetry import tracing
from worker.engine.decode_backend import DecodeBackend
from worker.engine.prefill_backend import PrefillBackend
from worker.metrics import WorkerMetrics
from worker.service.drain import DrainGate
from worker.service.embedding_pull import EmbeddingPuller
from worker.service.encoder_servicer import EncoderServicer
from worker.service.kv_event_log import KvEventLog, KvEventsServicer
from worker.service.kv_peer import KvPeerServicer, PeerPuller
from worker.service.lifecycle import ProcessPorts, serve_until_stopped
from worker.service.role_switch import RoleSwitch, WorkerControlServicer
from worker.service.options import SimulatedBackend, WorkerOptions
from worker.service.servicers import DecodeServicer, PrefillServicer
from worker.service.standard_health import StandardHealth
from worker.service.token_channel import TokenChannelListener
from worker.service.trust import WorkerTrust

logger = logging.getLogger(__name__)


def build_engine(options: WorkerOptions, runner=None) -> PrefillBackend | DecodeBackend:
    """The engine for the options' role from the options' backend, around `runner` (the model a role switch
    keeps) when given."""
    if isinstance(options.backend, SimulatedBackend):
        from worker.simulated.build import build_engine
    else:
        from worker.torch_engine.build import build_engine  # torch and the checkpoint: only for a real worker
    return build_engine(options, runner)


async def serve(options: WorkerOptions) -> None:
    """Serve (registered with the coordinator if one is named) until SIGTERM/SIGINT, then deregister,
    drain the requests in flight for up to `drain_seconds`, and stop. A role switch (`role_switch.py`) serves
    again in the new role, in the same process."""
    tracing.configure_from_env(f"pdserve-{options.role}")
    try:
        await _serve(options)
    finally:
        tracing.shutdown()  # the last requests' spans are exported, not lost


async def open_token_channels(servicer, kind: str, options: WorkerOptions, trust: WorkerTrust, closers: list,
                              kv_events: KvEventLog) -> None:
    """Listen for coordinators' token channels (unless --token-channel-port is -1); the servicer names the
    listener in its answers."""
    if options.token_channel_port < 0:
        return
    channels = TokenChannelListener(servicer.serve_on_channel, servicer.health_now, trust.worker_secret,
                                    trust.grpc_server, kind, kv_events)
    port = await channels.start(options.host, options.token_channel_port)
    servicer.token_channel_address = f"{options.public_host}:{port}"
    closers.append(channels.stop)


async def _serve(options: WorkerOptions) -> None:
    ports = ProcessPorts()
    role, runner = options.role, None
    while role is not None:
        switched_at = time.monotonic()
        # Each role uses its own links' files; bad ones fail before the model loads.
        trust = WorkerTrust.from_settings(role, options.tls, options.auth)
        engine = build_engine(replace(options, role=role), runner)
        loaded = getattr(engine, "runner", None)  # None: a simulated worker, which has no model
        if loaded is not None and loaded is not runner:
            ports.metrics.model_loads.inc()
        if ports.grpc_port is not None:
            logger.info("now a %s worker (engine built in %.0f ms, the model kept loaded)", role,
                        (time.monotonic() - switched_at) * 1000)
        runner = loaded
        role = await _serve_round(replace(options, role=role), trust, engine, ports)
        if role is not None:
            ports.metrics.role_switches.labels(role).inc()
            if runner is not None:
                runner.release_cache()  # the old role's KV cache goes before the new one is allocated
        engine = None


async def _serve_round(options: WorkerOptions, trust: WorkerTrust, engine, ports: ProcessPorts) -> str | None:
    """Serve one role until a signal (None) or a role switch (the new role)."""
    metrics = engine.metrics = ports.metrics.current = WorkerMetrics(options.role, engine)
    engine.start()
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=[CallerCheck(trust.worker_secret, trust.grpc_server)])
    gate = DrainGate()
    switch = RoleSwitch(options.role, options.drain_seconds)
    pb_grpc.add_WorkerControlServicer_to_server(WorkerControlServicer(switch, gate), server)
    health = StandardHealth(options.role)
    await health.not_serving_yet()
    health.add_to(server)
    # Every coordinator this worker serves follows its prefix cache, on a token channel or a Watch stream.
    kv_events = KvEventLog(engine.pool, options.role, asyncio.get_running_loop())
    pb_grpc.add_KvEventsServicer_to_server(KvEventsServicer(kv_events), server)
    if options.role != "encode":  # an encode worker's cache holds images, not KV blocks
        pb_grpc.add_KvPeerServicer_to_server(KvPeerServicer(engine, options.kv_chunk_bytes, metrics), server)
    gate.on_drain(kv_events.close)
    closers = []
    if options.role == "encode":
        pb_grpc.add_EncoderServiceServicer_to_server(EncoderServicer(engine, metrics, gate, options.kv_chunk_bytes),
                                                     server)
    elif options.role == "prefill":
        grpc_sender = GrpcKvSender(chunk_bytes=options.kv_chunk_bytes, timeout_s=options.kv_lease_timeout_s,
                                   tls=trust.grpc_client)
        tcp_sender = TcpKvSender(options.kv_chunk_bytes, tls=trust.kv_client)
        puller = PeerPuller(engine, grpc_sender.channels, trust.worker_secret, metrics, options.kv_trans_timeout_s)
        embeddings = EmbeddingPuller(grpc_sender.channels, trust.worker_secret, metrics, options.kv_trans_timeout_s)
        servicer = PrefillServicer(engine, grpc_sender, tcp_sender, options.kv_lease_timeout_s, metrics, gate, puller,
                                   embeddings)
        await open_token_channels(servicer, "prefill", options, trust, closers, kv_events)
        pb_grpc.add_PrefillServiceServicer_to_server(servicer, server)
        closers.append(grpc_sender.close)
    else:
        def on_kv(kv):
            engine.on_kv(kv)
            receipt = kv.receipt
            metrics.kv_bytes.labels("receive", receipt.transport).inc(receipt.num_bytes)
            metrics.kv_duration.labels("receive", receipt.transport).observe(receipt.receive_ms / 1000)

        loop, loop_thread = asyncio.get_running_loop(), threading.get_ident()

        def on_failure(request_id: str, message: str):
            # Called on the event loop, or on a receiver's thread when a stream's header is refused: the request's
            # events are the loop's.
            metrics.kv_failures.inc()
            if threading.get_ident() == loop_thread:
                engine.fail(request_id, message)
            else:
                loop.call_soon_threadsafe(engine.fail, request_id, message)

        tokens = KvTransferTokens()  # issued by the servicer in `accepted`, redeemed by the sink
        sink = KvSink(on_kv, on_failure, tokens, pool=engine.kv_pool, assembler=engine.kv_assembler,
                      on_refused=lambda request_id: metrics.kv_refused.inc())
        kv_data_address = ""
        if options.kv_data_port >= 0:
            receiver = TcpKvReceiver(sink, timeout_s=options.kv_trans_timeout_s, tls=trust.kv_server)
            kv_data_address = f"{options.public_host}:{await receiver.start(options.host, options.kv_data_port)}"
            closers.append(receiver.stop)
        servicer = DecodeServicer(engine, kv_data_address, tokens, metrics, gate)
        await open_token_channels(servicer, "decode", options, trust, closers, kv_events)
        pb_grpc.add_DecodeServiceServicer_to_server(servicer, server)
        pb_grpc.add_KvReceiverServicer_to_server(KvReceiverServicer(sink), server)

    await serve_until_stopped(server, options, gate, health, closers, engine, trust, switch, ports)
    return switch.next_role
