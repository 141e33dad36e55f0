"""ms_coordinator.json as pydantic models, loaded and validated once at start-up."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_serializer, field_validator,
                      model_validator)

from embedded_model.builder import ModelSpec
from coordinator.requests.draft_corpus import SpeculativeConfig
from coordinator.addresses import HTTP_URL, check_host_port, split_url
from coordinator.gateway.settings import GatewayConfig, SidecarConfig
from coordinator.scheduling.decode_rebalance import RebalanceConfig
from coordinator.tenancy.settings import TenancyConfig
from planner.settings import PlannerConfig
from security.settings import AuthConfig, TlsConfig


class _Section(BaseModel):
    # Unknown keys are typos until proven otherwise: fail start-up and name them.
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class HttpConfig(_Section):
    """Where clients reach the coordinator."""

    predict_ip: str = Field("127.0.0.1", description="Address the client APIs listen on (`--predict-ip` "
                            "overrides it).")
    predict_port: int = Field(1025, ge=0, le=65535, description="Port of the client APIs; 0 picks a free one "
                              "(`--predict-port` overrides it).")
    manage_ip: str = Field("127.0.0.1", description="Address of the management API: instance registration, "
                           "GET /v1/instances, GET /health, GET /metrics.")
    manage_port: int = Field(1026, ge=0, le=65535, description="Port of the management API; 0 picks a free one "
                             "(printed as `pdserve coordinator management: URL`).")
    drain_seconds: float = Field(30, ge=0, le=3600, description="On SIGTERM: stop accepting at once, let "
                                 "running requests finish for up to this long, exit 0.")
    # Longer than the clients' own pool idle timeouts (aiohttp's 15 s, httpx's 5 s), as nginx's and aiohttp's 75 s
    # are: a server that closes first races a client reusing the connection, whose request is then lost.
    keepalive_timeout_s: float = Field(75, gt=0, le=3600, description="A connection idle this long, or still "
                                       "sending its request headers, is closed. Keep it well above the clients' "
                                       "own idle timeouts (aiohttp's 15 s): a client reusing a connection as the "
                                       "coordinator closes it loses that request.")
    body_timeout_s: float = Field(30, gt=0, le=3600, description="A request body not fully received this long "
                                  "after its headers is a 408, which frees its slot.")
    tls_handshake_timeout_s: float = Field(10, gt=0, le=600, description="A TLS connection must start and "
                                           "finish its handshake within this.")


class ModelConfig(_Section):
    """The served model and the limits the coordinator enforces for it."""

    modelName: str = Field("", description="Name clients pass as `model`; empty = the name of the modelWeightPath "
                           "folder (the embedded model's, pdserve-tiny, when that is empty too).")
    modelWeightPath: str = Field("", description="Model folder for the tokenizer; empty = embedded default model.")
    maxSeqLen: int = Field(2048, ge=2, description="Prompt plus generated tokens, at most.")
    maxInputTokenLen: int = Field(2048, ge=1, description="Prompt tokens, at most.")
    maxIterTimes: int = Field(512, ge=1, description="Decode steps after the first token, at most.")
    fullTextEnabled: bool = Field(False, description="Every streaming API carries the cumulative text "
                                    "instead of deltas; the final OpenAI chunk carries `full_text`.")
    multimodalInputsDir: str = Field("/data/multimodal_inputs", description="Only local media files under this "
                                     "folder are accepted (paths resolved first: symlinks and `..` included).")
    mediaFetchTimeout: float = Field(10, gt=0, le=600, description="Seconds fetching one media URL (listed in "
                                     "ALLOWED_MEDIA_URLS_ENV) may take; past it, 400.")
    loraModules: dict[str, str] = Field(default_factory=dict, description="LoRA adapters served at start-up: name "
                                        "clients select it by (`model`, `adapter_id`) -> absolute path of its PEFT "
                                        "folder, as the workers see it. More load at run time "
                                        "(`POST /v1/load_lora_adapter` on the management port).")
    maxLoraRank: int = Field(16, ge=1, le=512, description="The largest LoRA rank served (start workers with the "
                             "same --max-lora-rank).")

    _name_from_folder: bool = PrivateAttr(False)

    @model_validator(mode="after")
    def _name_the_model(self) -> ModelConfig:
        # Resolved once here, so every reader (the APIs, /v1/models, /openapi.json) sees the same name.
        if not self.modelName:
            self.modelName = model_folder_name(self.modelWeightPath)
            self._name_from_folder = True
        return self

    @field_serializer("modelName")
    def _dump_name(self, name: str) -> str:
        # A name taken from the folder is written back empty: a copy given another modelWeightPath
        # (`pdserve up --config F --model DIR`) takes that folder's name, not the old one.
        return "" if self._name_from_folder else name


def model_folder_name(model_dir: str) -> str:
    """The name a model folder is served under: its last path component; the embedded model's name for ""."""
    if not model_dir:
        return ModelSpec().name
    return Path(os.path.abspath(model_dir)).name or ModelSpec().name




class InstanceConfig(_Section):
    """One worker the coordinator may route to: a pdserve worker (gRPC) or a vLLM instance (HTTP)."""

    engine: Literal["pdserve", "vllm"] = Field(
        "pdserve", description="pdserve: a `pdserve worker` reached over gRPC at `address`; vllm: a `vllm serve` "
        "instance reached over its OpenAI API at `url` (a prefill instance started with kv_role kv_producer, a "
        "decode instance with kv_consumer: docs/operating/vllm-engines.md).")
    address: str = Field("", description="pdserve: host:port of the worker's gRPC server. vllm: taken from "
                         "`url` (how /v1/instances and the metrics name the instance).")
    url: str = Field("", description="vllm: the instance's base URL, http://host:port or https://host:port "
                     "(https with tls_config.worker_grpc's CA and client certificate).")
    kv_events: str = Field("", description="vllm, for cache_affinity: where to subscribe to its KV events "
                           "(ZMQ; its --kv-events-config endpoint, which vLLM binds when it is tcp://*:PORT or "
                           "ipc://PATH): tcp://host:port or ipc://PATH; empty = routed on its load alone.")
    device: Literal["gpu", "cpu"] = Field("gpu", description="vllm: what the instance computes on; cpu (vLLM's CPU "
                                          "build, as `pdserve up --engine vllm` starts) refuses a client's seed with "
                                          "temperature > 0, which that build fails on.")
    speculative: Literal["", "ngram", "suffix"] = Field("", description="vllm decode instance: the method it drafts "
                                                        "by on every request, no request can turn off; empty: none.")

    @field_validator("address")
    @classmethod
    def _host_port(cls, value: str) -> str:
        return check_host_port(value) if value else value

    @field_validator("url")
    @classmethod
    def _base_url(cls, value: str) -> str:
        if not value:
            return value
        check_host_port(split_url(value, *HTTP_URL)[1].rstrip("/"))
        return value.rstrip("/")

    @field_validator("kv_events")
    @classmethod
    def _zmq_endpoint(cls, value: str) -> str:
        if not value:
            return value
        scheme, rest = split_url(value, ("tcp", "ipc"), "tcp://host:port or ipc://PATH")
        if scheme == "tcp":
            check_host_port(rest)
        return value

    @model_validator(mode="after")
    def _engine_fields(self) -> InstanceConfig:
        if self.engine == "pdserve":
            if self.url or self.kv_events or self.device != "gpu" or self.speculative:
                raise ValueError("url, kv_events, device and speculative are for engine vllm; a pdserve worker has "
                                 "an address")
            if not self.address:
                raise ValueError("address: a pdserve worker needs host:port")
            return self
        if not self.url:
            raise ValueError("url: engine vllm needs http://host:port or https://host:port")
        derived = self.url.partition("://")[2]
        if self.address and self.address != derived:
            raise ValueError(f"address {self.address!r} differs from url's host:port {derived!r}: leave it out")
        self.address = derived
        return self


class InstancesConfig(_Section):
    """The static instance lists; workers started with `--coordinator` register on top of them."""

    prefill: list[InstanceConfig] = Field([], description='Static prefill instances: {"address": "host:port"} for '
                                          'a pdserve worker, {"engine": "vllm", "url": URL} for a vLLM instance.')
    decode: list[InstanceConfig] = Field([], description="Static decode instances, as `prefill`.")

    @model_validator(mode="after")
    def _one_engine(self) -> InstancesConfig:
        # The two sides of a transfer must speak one protocol: a pdserve prefill cannot feed a vLLM decode.
        engines = {i.engine for i in self.prefill + self.decode}
        if len(engines) > 1:
            raise ValueError("every instance must have the same engine (pdserve or vllm): a KV transfer runs "
                             "between two instances of one engine")
        return self

    @property
    def engine(self) -> str:
        """The engine of every instance: pdserve when none is listed (workers then register)."""
        return next((i.engine for i in self.prefill + self.decode), "pdserve")

    def seeded_sampling(self) -> bool:
        """Whether every vLLM instance can sample from a client's seed (none runs vLLM's CPU build)."""
        return all(i.device == "gpu" for i in self.prefill + self.decode)

    def urls(self) -> dict[str, str]:
        """Each vLLM instance's base URL by its address."""
        return {i.address: i.url for i in self.prefill + self.decode if i.engine == "vllm"}

    def kv_event_endpoints(self) -> dict[str, str]:
        """Each vLLM instance's KV events endpoint by its address, where it gave one."""
        return {i.address: i.kv_events for i in self.prefill + self.decode if i.kv_events}


class HealthConfig(_Section):
    """How instances are watched and taken out of rotation (circuit breaker)."""

    check_interval_s: float = Field(2.0, gt=0, le=600, description="Seconds between health checks of each instance.")
    check_timeout_s: float = Field(2.0, gt=0, le=600, description="Seconds a health check may take.")
    failure_threshold: int = Field(3, ge=1, le=100,
                                   description="Consecutive failed requests or checks that take an instance out.")
    heartbeat_interval_s: float = Field(2.0, gt=0, le=600, description="Heartbeat period told to registering workers.")
    heartbeat_timeout_s: float = Field(10.0, gt=0, le=3600,
                                       description="A registered worker silent this long is taken out.")
    forget_after_s: float = Field(300.0, gt=0, description="A registered worker silent this long is forgotten.")
    silence_timeout_s: float = Field(
        2.0, gt=0, le=600, description="A worker with requests in flight that sent nothing this long (less for a "
        "decode worker whose steps are fast: 50 steps' worth, at least 0.5 s) gets a health probe at once.")
    silence_probe_timeout_s: float = Field(
        1.5, gt=0, le=600, description="A silent worker whose probe gets no answer within this is declared lost: "
        "its streams migrate and it is out of rotation until a health check passes.")


class SchedulerConfig(_Section):
    """How a prefill and a decode instance are picked for each request."""

    algorithm_type: Literal["round_robin", "load_balance", "cache_affinity"] = Field(
        "round_robin", description="Instance selection policy: round_robin (each role's instances in turn), "
        "load_balance (least outstanding work) or cache_affinity (the cheapest instance by what its prefix cache "
        "holds of the prompt, as its KV events tell, and its load: see the two weights).")
    cache_affinity_prefill_load_weight: float = Field(
        1.0, ge=0, le=1000, description="cache_affinity: a prefill instance costs its uncached prompt tokens plus "
        "this times the prompt tokens queued on it (both are tokens to compute before the first token).")
    cache_affinity_decode_load_weight: float = Field(
        64.0, ge=0, le=1_000_000, description="cache_affinity: a decode instance costs the prompt tokens it does "
        "not hold (to transfer, or to prefill locally) plus this many per sequence running or waiting on it.")
    cache_affinity_lora_load_tokens: float = Field(
        256.0, ge=0, le=1_000_000, description="cache_affinity: an instance that has not loaded the request's LoRA "
        "adapter (as its last health check said) costs this many prompt tokens more: loading it takes time.")
    cache_affinity_tier_token_cost: float = Field(
        0.1, ge=0, le=1, description="cache_affinity: a prompt token an instance holds only in its KV tier (local "
        "disk) costs this fraction of one it must compute: loading its block back is cheaper than computing it "
        "(measured in docs/benchmarks/kv-tier.md).")
    cache_affinity_peer_pulls: bool = Field(
        True, description="cache_affinity on pdserve's own workers: a prefill worker that lacks a prompt's leading "
        "blocks which another worker holds (pool or tier, any role) pulls them from it over the KV transfer path "
        "instead of computing them, when that saves at least cache_affinity_pull_min_tokens (vLLM instances: off).")
    cache_affinity_pull_min_tokens: int = Field(
        64, ge=1, le=1_000_000, description="cache_affinity: the fewest prompt tokens a peer pull must save; below "
        "it the call's fixed cost outweighs computing them.")
    cache_affinity_pull_token_cost: float = Field(
        0.2, ge=0, le=1, description="cache_affinity: a prompt token pulled from a peer costs this fraction of one "
        "computed (measured in docs/benchmarks/kv-tier.md).")
    cache_affinity_expected_ttl_s: float = Field(
        10.0, ge=0, le=600, description="cache_affinity: a prompt just routed counts as held by its instances for "
        "this long, until their KV events confirm it, so a burst sharing a new prefix lands on one worker; 0: off.")
    local_prefill_max_tokens: int = Field(
        0, ge=0, description="Conditional disaggregation: a prompt is prefilled on the chosen decode worker "
        "itself when the part of it that worker does not hold (all of it, unless cache_affinity knows better) is "
        "shorter than this; 0 = always disaggregate.")

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data):
        if isinstance(data, dict):
            for name, why in _REMOVED_SCHEDULER_FIELDS.items():
                if name in data:
                    raise ValueError(f"{name} was removed: {why}")
        return data


# Fields of earlier releases, refused with what replaced them rather than as unknown keys.
_REMOVED_SCHEDULER_FIELDS = {
    "cache_affinity_block_tokens": "the block size is each worker's own (--block-size), announced in its KV events",
    "cache_affinity_max_load_ratio": "cache_affinity weighs load against cached tokens; see "
                                     "cache_affinity_prefill_load_weight and cache_affinity_decode_load_weight",
    "cache_affinity_load_slack_tokens": "see cache_affinity_prefill_load_weight",
}


class RequestLimitConfig(_Section):
    """How much the coordinator takes on at once."""

    max_requests: int = Field(10000, ge=1, description="Generation requests in flight; past it, 429 "
                              "with Retry-After: 1 at once.")
    max_running: int = Field(1000, ge=1, description="Generations on the workers at once; the rest wait in a "
                             "queue ordered by priority, then arrival.")
    body_limit: int = Field(8, ge=1, le=1024, description="Largest request body, in MB; past it, 413.")
    grammar_cache_size: int = Field(256, ge=1, le=100000, description="Distinct guided-decoding grammars kept "
                                    "compiled (least recently used dropped first).")


class ExceptionConfig(_Section):
    """Deadlines that keep any request from hanging."""

    max_retry: int = Field(5, ge=0, le=100, description="Attempts on other instances when one fails before the "
                           "first token (a prefill or decode worker unreachable or gone, a KV transfer that "
                           "failed or stalled), invisibly to the client.")
    max_migrations: int = Field(3, ge=0, le=100, description="Times a request moves to another decode instance "
                                "when its decode worker is lost; 0 = fail the request instead.")
    first_token_timeout: float = Field(600, gt=0, le=3600, description="Seconds from an attempt's dispatch to "
                                        "its first token, else 504.")
    infer_timeout: float = Field(600, gt=0, le=3600, description="Seconds for the whole request, queueing "
                                  "included; a request's own `timeout` (MindIE, Triton) may only shorten it.")


class BackupConfig(_Section):
    """Coordinators that share one cluster through etcd: the worker registry, health verdicts, and in
    active_standby the one active coordinator. Without etcd_endpoints a coordinator stands alone."""

    etcd_endpoints: list[str] = Field([], description="etcd client URLs, http://host:port or https://host:port "
                                      "(TLS as tls_config.etcd); tried in order; empty = no etcd.")
    key_prefix: str = Field("/pdserve", description="Every key of this cluster starts with it; coordinators sharing "
                            "a prefix share a cluster.")
    mode: Literal["active_standby", "replicas"] = Field(
        "active_standby", description="active_standby: one coordinator (the holder of the leader key) serves "
        "clients, the others answer 503 until it is gone; replicas: every coordinator serves.")
    lease_ttl_s: int = Field(3, ge=1, le=600, description="active_standby: the leader key's lease, in whole "
                             "seconds (as etcd counts them), refreshed every lease_ttl_s / 3; a standby tries "
                             "to take over every lease_ttl_s / 6.")
    sync_interval_s: float = Field(1, gt=0, le=600, description="How often the registry and the health verdicts "
                                   "are re-read from etcd.")
    etcd_timeout_s: float = Field(1, gt=0, le=60, description="Seconds one etcd call may take, across all "
                                  "etcd_endpoints: each endpoint tried gets an equal share of it.")
    coordinator_name: str = Field("", description="This coordinator's name in etcd (leader key, health verdicts); "
                                  "empty = predict_ip:predict_port.")

    @field_validator("etcd_endpoints")
    @classmethod
    def _urls(cls, endpoints: list[str]) -> list[str]:
        for url in endpoints:
            check_host_port(split_url(url, *HTTP_URL)[1].rstrip("/"))
        return [url.rstrip("/") for url in endpoints]

    @model_validator(mode="after")
    def _census_outlives_a_round(self) -> BackupConfig:
        if self.mode == "replicas" and self.sync_interval_s > self.lease_ttl_s / 2:
            raise ValueError(f"mode replicas: sync_interval_s ({self.sync_interval_s:g}) must be at most half of "
                             f"lease_ttl_s ({self.lease_ttl_s}): each round refreshes the replica's counted lease")
        return self

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, prefix: str) -> str:
        if not prefix.startswith("/") or prefix.rstrip("/") == "":
            raise ValueError(f"must start with / and name something, got {prefix!r}")
        return prefix.rstrip("/")


class CoordinatorConfig(_Section):
    """The whole ms_coordinator.json."""

    http_config: HttpConfig = HttpConfig()
    model_settings: ModelConfig = Field(ModelConfig(), alias="model_config")
    instances: InstancesConfig = InstancesConfig()
    health_config: HealthConfig = HealthConfig()
    digs_scheduler_config: SchedulerConfig = SchedulerConfig()
    request_limit: RequestLimitConfig = RequestLimitConfig()
    exception_config: ExceptionConfig = ExceptionConfig()
    tls_config: TlsConfig = TlsConfig()
    auth_config: AuthConfig = AuthConfig()
    backup_config: BackupConfig = BackupConfig()
    planner_config: PlannerConfig = PlannerConfig()
    rebalance_config: RebalanceConfig = RebalanceConfig()
    tenancy_config: TenancyConfig = TenancyConfig()
    speculative_config: SpeculativeConfig = SpeculativeConfig()
    gateway_config: GatewayConfig = GatewayConfig()
    sidecar_config: SidecarConfig = SidecarConfig()

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), populate_by_name=True)

    @model_validator(mode="after")
    def _planner_sees_all_traffic(self) -> CoordinatorConfig:
        if self.planner_config.enabled and self.backup_config.etcd_endpoints and self.backup_config.mode == "replicas":
            raise ValueError("planner_config.enabled needs backup_config.mode active_standby: replicas each see a "
                             "share of the traffic, and the planner decides on the active coordinator's")
        if self.planner_config.enabled and self.instances.engine == "vllm":
            raise ValueError("planner_config.enabled: the online planner fits pdserve workers' own step timings, "
                             "which vLLM instances do not report, and vLLM instances cannot switch roles")
        return self

    @model_validator(mode="after")
    def _etcd_tls_matches_the_endpoints(self) -> CoordinatorConfig:
        endpoints, tls = self.backup_config.etcd_endpoints, self.tls_config.etcd.tls_enable
        plain = [url for url in endpoints if url.startswith("http://")]
        if tls and plain:
            raise ValueError(f"tls_config.etcd.tls_enable is set but these backup_config.etcd_endpoints are "
                             f"plain http: {plain}")
        if not tls and len(plain) < len(endpoints):
            raise ValueError("backup_config.etcd_endpoints has https:// URLs: set tls_config.etcd (tls_enable, "
                             "ca_cert)")
        if self.tls_config.etcd.tls_passwd:
            raise ValueError("tls_config.etcd.tls_passwd: etcd's HTTP client cannot read an encrypted key; give "
                             "it an unencrypted tls_key (a Secret mounted for the coordinator only)")
        return self

    @model_validator(mode="after")
    def _vllm_urls_match_the_worker_link(self) -> CoordinatorConfig:
        tls = self.tls_config.worker_grpc.tls_enable
        for address, url in self.instances.urls().items():
            if url.startswith("https://") != tls:
                raise ValueError(f"instances: vLLM instance {url}: https:// goes with tls_config.worker_grpc "
                                 f"(tls_enable, ca_cert, and a client certificate for --ssl-cert-reqs 2), http:// "
                                 f"without it")
        return self


class ConfigError(Exception):
    """ms_coordinator.json is missing, not JSON, or invalid; the message names the key."""


def _describe(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(root)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{source}: {where}: {msg}")
    return "\n".join(lines)


def parse_config(data: object, source: str = "ms_coordinator.json") -> CoordinatorConfig:
    try:
        return CoordinatorConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None


def load_config(path: Path | str) -> CoordinatorConfig:
    """Read and validate a config file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    config = parse_config(data, str(path))
    # Certificate, key and secret paths are read relative to the config file, as an operator writes them.
    base = path.resolve().parent
    config.tls_config = config.tls_config.resolved(base)
    config.auth_config = config.auth_config.resolved(base)
    config.planner_config = config.planner_config.resolved(base)
    return config
