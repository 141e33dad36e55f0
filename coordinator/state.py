"""What every handler needs, created once per app."""

from __future__ import annotations

import time
from pathlib import Path
from dataclasses import dataclass, field

from aiohttp import web

from coordinator.limits import ModelLimits
from coordinator.pipeline import RequestPipeline
from coordinator.routing import RoundRobinRouter
from coordinator.tokenization import PromptTokenizer
from coordinator.worker_client import WorkerClient


@dataclass
class CoordinatorState:
    """The coordinator's long-lived parts."""

    model_name: str
    full_text: bool
    tokenizer: PromptTokenizer
    limits: ModelLimits
    client: WorkerClient
    router: RoundRobinRouter
    pipeline: RequestPipeline
    media_dir: Path = Path("/data/multimodal_inputs")
    body_limit_mb: int = 8
    started_at: int = field(default_factory=lambda: int(time.time()))


STATE = web.AppKey("state", CoordinatorState)
