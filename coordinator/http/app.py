"""create_app(config) and the coordinator process's run loop."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from aiohttp import web

from coordinator.apis.fields import BODY_TIMEOUT
from coordinator.http.auth import API_KEYS, ApiKeyGate, load_api_keys
from coordinator.cluster.node import ClusterNode
from coordinator.cluster.standby_gate import StandbyGate
from coordinator.cluster.wire_formats import ClusterFormats
from coordinator.config import ConfigError, CoordinatorConfig
from coordinator.gateway.endpoint_picker import CoordinatorPicker
from coordinator.gateway.sidecar import SIDECAR, SidecarAdmission, SidecarAnnouncer
from coordinator.http.request_gate import InFlightLimit, RequestGate, error_middleware
from coordinator.workers.health_monitor import HealthMonitor
from coordinator.workers.silence_watch import SilenceWatch
from coordinator.workers.instances import InstanceRegistry
from coordinator.workers.kv_event_watch import KvEventWatch
from coordinator.requests.limits import ModelLimits
from coordinator.requests.loras import LoraRegistry
from coordinator.http.management import MANAGEMENT_ROUTES
from coordinator.requests.media import MediaFetcher
from coordinator.metrics import METRICS, CoordinatorMetrics
from coordinator.requests.draft_corpus import DraftCorpus
from coordinator.requests.encoding import EncoderCounters, ImageEncoding
from coordinator.requests.pipeline import RequestPipeline
from coordinator.planning.planner_loop import PlannerLoop
from coordinator.scheduling.decode_rebalance import DecodeRebalancer
from planner.profile import ProfileError
from coordinator.requests.queue import RequestQueue
from coordinator.tenancy.admission import ADMISSION, Admission
from coordinator.http.route_table import ROUTE_TABLE
from coordinator.http.routes import PREDICT_ROUTES
from coordinator.scheduling.kv_index import KvIndex
from coordinator.scheduling.policies import make_policy
from coordinator.scheduling.router import Router
from coordinator.state import STATE, CoordinatorState
from coordinator.requests.tokenization import PromptTokenizer
from guidance.compiler import compiler_for
from coordinator.http.trust import TRUST, CoordinatorTrust
from coordinator.workers.vllm.client import VllmClient
from coordinator.workers.vllm.kv_events import VllmKvEventWatch
from coordinator.workers.client import WorkerClient
from security.tls import link_tls

logger = logging.getLogger(__name__)

def served_adapters(model, tokenizer: PromptTokenizer) -> LoraRegistry:
    """The LoRA adapters `model_config.loraModules` names, checked (ConfigError naming the key otherwise)."""
    loras = LoraRegistry.for_model(model.modelName, tokenizer.model_config, model.maxLoraRank)
    for name, path in model.loraModules.items():
        try:
            loras.load(name, path)
        except ValueError as exc:
            raise ConfigError(f"model_config.loraModules.{name}: {exc}") from None
    return loras


def create_app(config: CoordinatorConfig) -> web.Application:
    """Build the client-facing app; workers are reached lazily over cached gRPC channels."""
    from embedded_model import ensure_default_model

    api_keys = load_api_keys(config.auth_config)  # first: a broken keys file fails start-up before the model loads
    model = config.model_settings
    model_dir = model.modelWeightPath or str(ensure_default_model())
    tokenizer = PromptTokenizer(model_dir)
    limits = ModelLimits(
        max_seq_len=model.maxSeqLen,
        max_input_token_len=model.maxInputTokenLen,
        max_iter_times=model.maxIterTimes,
        max_position_embeddings=tokenizer.max_position_embeddings,
    )
    loras = served_adapters(model, tokenizer)
    health = config.health_config
    trust = CoordinatorTrust.from_config(config)
    engine = config.instances.engine
    # vLLM instances are spoken to over their OpenAI API (coordinator/workers/vllm/), pdserve workers over gRPC.
    client = (VllmClient(config.instances.urls(), trust.worker_tls, trust.worker_secret,
                         config.instances.seeded_sampling()) if engine == "vllm"
              else WorkerClient(trust.worker_tls, trust.worker_secret))
    registry = InstanceRegistry([i.address for i in config.instances.prefill],
                                [i.address for i in config.instances.decode],
                                failure_threshold=health.failure_threshold,
                                heartbeat_timeout_s=health.heartbeat_timeout_s, forget_after_s=health.forget_after_s)
    scheduling = config.digs_scheduler_config
    # cache_affinity routes on an exact index of the workers' prefix caches, fed by their KV events.
    kv_watch = None
    if scheduling.algorithm_type == "cache_affinity":
        index = KvIndex(scheduling.cache_affinity_expected_ttl_s)
        kv_watch = (VllmKvEventWatch(index, config.instances.kv_event_endpoints(), loras.digest_of)
                    if engine == "vllm"
                    else KvEventWatch(index, client))
    # vLLM instances cannot serve or take peer pulls (pdserve's KvPeer): their prompts are computed.
    policy = make_policy(scheduling, kv_watch.index if kv_watch is not None else None,
                         peer_pulls=False if engine == "vllm" else None)
    if engine == "vllm":
        client.read_load = policy.reads_load
    router = Router(registry, policy, scheduling.local_prefill_max_tokens)
    metrics = CoordinatorMetrics()
    queue = RequestQueue(config.request_limit.max_running, config.tenancy_config.refuse_early)
    metrics.watch(queue, registry, kv_watch.index if kv_watch is not None else None)
    # A vLLM decode instance's speculative decoding runs on every request: `x-pdserve-speculative: off` is refused.
    fixed_drafting = next((i.speculative for i in config.instances.decode if i.speculative), "")
    admission = Admission(config.tenancy_config, limits, api_keys, fixed_drafting)
    metrics.watch_tenants(admission.book)
    exceptions = config.exception_config
    pipeline = RequestPipeline(client, router, registry, limits, queue, exceptions.first_token_timeout,
                               exceptions.infer_timeout, metrics, exceptions.max_retry, exceptions.max_migrations)
    # Encode workers' cached images (their KV events, one per image) route each image of a request (encoding.py).
    embeddings_watch = None
    if engine == "pdserve":
        embeddings_watch = KvEventWatch(KvIndex(), client, roles=("encode",))
        pipeline.encoding = ImageEncoding(client, registry, embeddings_watch.index, exceptions.first_token_timeout,
                                          EncoderCounters(metrics.registry))

    async def forget(instance):
        await client.forget(instance.address)

    monitor = HealthMonitor(registry, client, health.check_interval_s, health.check_timeout_s, on_forget=forget)
    silence = SilenceWatch(registry, client, health.silence_timeout_s, health.silence_probe_timeout_s)
    limit = InFlightLimit(config.request_limit.max_requests)
    # Coordinators on etcd share the registered workers; in active_standby a standby refuses client requests.
    on_etcd = bool(config.backup_config.etcd_endpoints)

    # A deregistration seen on etcd is as one on this coordinator: its channels stay open, so requests on it run
    # to their end (its KV index entries go as the registry removes it).
    cluster = ClusterNode.from_config(config, registry, monitor) if on_etcd else None
    auth = config.auth_config
    gate = RequestGate(
        PREDICT_ROUTES, metrics, limit,
        keys=None if api_keys is None else ApiKeyGate(api_keys, metrics, open_health=auth.open_health,
                                                      open_metrics=auth.open_metrics),
        standby=None if cluster is None else StandbyGate(cluster.leadership))
    app = web.Application(middlewares=[gate.middleware], client_max_size=config.request_limit.body_limit * 1024 * 1024)
    app[API_KEYS] = api_keys
    sidecar = config.sidecar_config
    if sidecar.enabled:  # behind a gateway: its picker admits tenants, the header names the prefill worker
        app[SIDECAR] = SidecarAdmission(admission)
    else:
        app[ADMISSION] = admission
    state = app[STATE] = CoordinatorState(
        model.modelName, model.fullTextEnabled, tokenizer, limits, client, registry, router, monitor, pipeline,
        heartbeat_interval_s=health.heartbeat_interval_s, media_dir=Path(model.multimodalInputsDir),
        media=MediaFetcher(model.mediaFetchTimeout),
        body_limit_mb=config.request_limit.body_limit,
        grammars=compiler_for(tokenizer.tokenizer, cache_size=config.request_limit.grammar_cache_size)[0])
    state.cluster = cluster
    if cluster is not None and cluster.census is not None:
        cluster.census.on_count = admission.book.share
    state.kv_watch = kv_watch
    if config.planner_config.enabled:
        try:
            state.planner = pipeline.planner = PlannerLoop(config.planner_config, registry,
                                                           scheduling.algorithm_type, cluster)
        except ProfileError as exc:  # the message names the file
            raise ConfigError(f"planner_config: {exc}") from None
        metrics.watch_planner(state.planner)
        if pipeline.encoding is not None:
            pipeline.encoding.on_encoded = state.planner.encoded
    # vLLM instances take no draft hints (they draft from the request alone, if at all): no corpus for them.
    if config.speculative_config.enabled and engine != "vllm":
        pipeline.drafts = DraftCorpus(config.speculative_config, model.modelName)
        metrics.watch_drafts(pipeline.drafts)
    rebalancer = None
    if config.rebalance_config.enabled:
        rebalancer = pipeline.attempts.rebalancer = DecodeRebalancer(config.rebalance_config, registry)
    state.engine = engine
    state.loras = loras
    state.formats = ClusterFormats(registry, engine=engine)
    if engine == "pdserve":
        pipeline.attempts.formats = state.formats
    if cluster is not None:
        cluster.formats = state.formats
    if config.gateway_config.enabled:
        state.picker = CoordinatorPicker(state, admission, api_keys, config.gateway_config)
        metrics.registry.register(state.picker.metrics)
    announcer = None
    if sidecar.enabled and sidecar.announce_to:
        announcer = SidecarAnnouncer(sidecar, config.gateway_config.sidecar_ttl_s,
                                     link_tls("tls_config.registration", config.tls_config.registration, "client"),
                                     trust.registration_token)

    async def background(app: web.Application):
        if kv_watch is not None:
            kv_watch.start(registry)
        if embeddings_watch is not None:
            embeddings_watch.start(registry)
        monitor.start()
        # One probe of every configured instance now, not after the first interval: its release and wire formats
        # (and its load) are known from the start. Not awaited: an instance that is down must not delay start-up.
        first_probe = asyncio.create_task(monitor.check_all())
        silence.start()
        if cluster is not None:
            await cluster.start()
        if state.planner is not None:
            state.planner.start()
        if rebalancer is not None:
            rebalancer.rounds.start()
        if announcer is not None:
            await announcer.start()
        yield
        if announcer is not None:
            await announcer.stop()
        first_probe.cancel()
        if rebalancer is not None:
            await rebalancer.rounds.stop()
        if state.planner is not None:
            await state.planner.stop()
        if cluster is not None:
            await cluster.stop()
        await silence.stop()
        await monitor.stop()
        for watch in (kv_watch, embeddings_watch):
            if watch is not None:
                await watch.stop()
        await client.close()
        await state.media.close()

    app.cleanup_ctx.append(background)
    app[METRICS] = metrics
    app[TRUST] = trust
    app[BODY_TIMEOUT] = config.http_config.body_timeout_s
    app[ROUTE_TABLE] = PREDICT_ROUTES
    PREDICT_ROUTES.add_to(app)
    return app


def create_management_app(main_app: web.Application) -> web.Application:
    """The management port: registration, instances, health and metrics, apart from client traffic."""
    app = web.Application(middlewares=[error_middleware])
    app[STATE] = main_app[STATE]
    app[METRICS] = main_app[METRICS]
    app[TRUST] = main_app[TRUST]
    app[BODY_TIMEOUT] = main_app[BODY_TIMEOUT]
    app[ROUTE_TABLE] = MANAGEMENT_ROUTES
    MANAGEMENT_ROUTES.add_to(app)
    return app
