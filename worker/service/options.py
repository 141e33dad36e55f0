"""Command-line settings of one worker process: the shared ones, and the backend that runs the forwards."""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_transfer.wire import DEFAULT_CHUNK_BYTES
from security.settings import AuthConfig, TlsConfig
from worker.engine.speculative.config import SpeculativeConfig
from worker.simulated.cost_model import CostModel, KvShape

ROLES = ("prefill", "decode")  # a role switch's; an encode worker keeps its role
ALL_ROLES = (*ROLES, "encode")


@dataclass(frozen=True)
class ModelBackend:
    """The real engines: a checkpoint run with torch."""

    model_dir: str
    dtype: str = "auto"
    device: str = "auto"  # auto: the first CUDA device when there is one, else the CPU
    threads: int | None = None  # torch intra-op threads; None: torch's default (one per core)
    # a vision-language model's encoder outputs kept by image content hash; 0: off; None: 32, 256 on an encode worker
    encoder_cache_images: int | None = None
    max_loras: int | None = None  # LoRA adapters resident at once; None: 4 on a text model, 0 on a vision one
    max_lora_rank: int = 16  # the largest adapter rank it loads
    attention: str = "auto"  # kernel | torch | auto (model_support.resolve_attention)
    enforce_eager: bool = False  # never capture decode steps as CUDA graphs (they run eagerly, as on the CPU)
    speculative: SpeculativeConfig | None = None  # decode: draft and verify several tokens per step; None: off


@dataclass(frozen=True)
class SimulatedBackend:
    """No model (and no torch): forwards timed by `cost`, synthetic tokens, KV streams sized as `kv_shape`."""

    cost: CostModel = field(default_factory=CostModel)
    kv_shape: KvShape = field(default_factory=KvShape)
    vocab_size: int = 32000
    kv_budget_tokens: int = 1 << 20  # the default budget: there is no device memory to size it from


@dataclass(frozen=True)
class WorkerOptions:
    """Settings of one worker process, whatever its backend."""

    role: str
    backend: ModelBackend | SimulatedBackend
    host: str = "127.0.0.1"
    port: int = 0
    kv_trans_timeout_s: float = 10.0
    kv_lease_timeout_s: float = 30.0
    kv_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    kv_budget_tokens: int | None = None  # None: the backend's default (real: a share of the memory free at start-up)
    block_size: int = 16  # token positions per KV block
    prefix_caching: bool = True  # keep full blocks cached for later prompts with the same leading tokens
    kv_tier_dir: str | None = None  # the KV tier's folder (local disk); needs kv_tier_gb > 0
    kv_tier_gb: float = 0.0  # the KV tier's size; 0: no tier
    max_prefill_tokens: int = 2048
    max_prefill_batch_size: int = 16
    max_running: int = 64
    max_encode_batch_images: int = 16  # encode: images of concurrent requests in one vision forward
    kv_data_port: int = 0  # decode: raw-TCP KV receiver port; 0 picks one, -1 disables (gRPC PushKv only)
    # the token channel listener (a decode worker's carries coordinators' decode requests and their tokens, one
    # frame per step; a prefill worker's their prefills); 0 picks one, -1 disables (a gRPC call per request)
    token_channel_port: int = 0
    metrics_port: int = 0  # Prometheus /metrics; 0 picks one, -1 disables
    # grpc.health.v1 alone, in plaintext, for probes that cannot reach a TLS gRPC port; -1 (the default): none,
    # 0 picks one. The gRPC port answers grpc.health.v1 either way.
    health_port: int = -1
    coordinator_url: str | None = None  # the coordinator's management URL to register with; None: no registration
    advertise_host: str | None = None  # the host others reach this worker at (e.g. a pod IP); None: `host`
    heartbeat_interval_s: float = 2.0  # until the coordinator's register answer names its own interval
    drain_seconds: float = 30.0  # on SIGTERM: longest wait for requests in flight before stopping anyway
    tls: TlsConfig = field(default_factory=TlsConfig)  # the links it is on (from --security-config)
    auth: AuthConfig = field(default_factory=AuthConfig)  # the worker secret and registration token files

    def __post_init__(self):
        if self.role not in ALL_ROLES:
            raise ValueError(f"role must be one of {', '.join(ALL_ROLES)}, got {self.role!r}")
        if self.role == "encode" and isinstance(self.backend, SimulatedBackend):
            raise ValueError("--role encode needs a vision-language model: a simulated worker has no vision tower")
        if self.max_encode_batch_images < 1:
            raise ValueError(f"--max-encode-batch-images must be >= 1, got {self.max_encode_batch_images}")
        if self.kv_tier_gb < 0:
            raise ValueError(f"--kv-tier-gb must be >= 0, got {self.kv_tier_gb}")
        if self.kv_tier_gb and isinstance(self.backend, ModelBackend) and not self.kv_tier_dir:
            raise ValueError("--kv-tier-gb needs --kv-tier-dir (the folder on local disk that holds the tier)")
        if self.kv_tier_gb and not self.prefix_caching:
            raise ValueError("--kv-tier-gb keeps prefix-cache blocks: it cannot go with --no-prefix-caching")

    @property
    def public_host(self) -> str:
        """The host others dial: a worker listening on 0.0.0.0 must tell them an address they can reach."""
        return self.advertise_host or self.host
