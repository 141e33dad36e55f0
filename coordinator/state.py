"""What every handler needs, created once per app."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from coordinator.workers.health_monitor import HealthMonitor
from coordinator.workers.instances import InstanceRegistry
from coordinator.requests.limits import ModelLimits
from coordinator.requests.loras import LoraRegistry
from coordinator.requests.media import MediaFetcher
from coordinator.requests.pipeline import RequestPipeline
from coordinator.scheduling.router import Router
from coordinator.requests.tokenization import PromptTokenizer
from coordinator.workers.vllm.client import VllmClient
from coordinator.workers.client import WorkerClient
from guidance.compiler import GrammarCompiler

if TYPE_CHECKING:
    from coordinator.cluster.node import ClusterNode
    from coordinator.cluster.wire_formats import ClusterFormats
    from coordinator.gateway.endpoint_picker import CoordinatorPicker
    from coordinator.planning.planner_loop import PlannerLoop
    from coordinator.workers.kv_event_watch import InstanceFollowers


@dataclass
class CoordinatorState:
    """The coordinator's long-lived parts."""

    model_name: str
    full_text: bool
    tokenizer: PromptTokenizer
    limits: ModelLimits
    client: WorkerClient | VllmClient  # the engine's: pdserve workers over gRPC, or vLLM instances over HTTP
    registry: InstanceRegistry
    router: Router
    health_monitor: HealthMonitor
    pipeline: RequestPipeline
    heartbeat_interval_s: float = 2.0
    media_dir: Path = Path("/data/multimodal_inputs")
    media: MediaFetcher = field(default_factory=MediaFetcher)  # gets the images a request names
    body_limit_mb: int = 8
    grammars: GrammarCompiler | None = None  # guided-decoding grammars checked before any worker is used
    started_at: int = field(default_factory=lambda: int(time.time()))
    cluster: ClusterNode | None = None  # with backup_config.etcd_endpoints: the coordinators on etcd
    kv_watch: InstanceFollowers | None = None  # with cache_affinity: the instances' KV events, into its index
    engine: str = "pdserve"  # of every instance: "vllm" takes no registrations (config.InstancesConfig)
    loras: LoraRegistry | None = None  # the LoRA adapters served beside the model (set by create_app)
    planner: PlannerLoop | None = None  # with planner_config.enabled: the online planner (GET /v1/plan)
    formats: ClusterFormats | None = None  # the wire versions the cluster writes, and its finalize (set by create_app)
    picker: CoordinatorPicker | None = None  # with gateway_config.epp_port: the endpoint picker a gateway asks

    def instances(self) -> dict:
        """Every instance as GET /v1/instances shows it: with what the KV index holds of it, when there is one."""
        snapshot = self.registry.snapshot()
        if self.kv_watch is not None:
            for group in snapshot.values():
                for instance in group:
                    instance["kv_index"] = self.kv_watch.index.describe(instance["address"])
        return snapshot


STATE = web.AppKey("state", CoordinatorState)
