"""The real backend's engine for a worker's options: load the checkpoint, size the KV budget."""

from __future__ import annotations

from worker.engine.decode_engine import DecodeEngine
from worker.engine.kv_budget import default_capacity_tokens
from worker.engine.model_runner import ModelRunner
from worker.engine.prefill_engine import PrefillEngine


def build_engine(options) -> PrefillEngine | DecodeEngine:
    """`options` is a WorkerOptions whose backend is a ModelBackend."""
    runner = ModelRunner(options.backend.model_dir, options.backend.dtype)
    budget = options.kv_budget_tokens or default_capacity_tokens(runner.kv_bytes_per_token())
    if options.role == "prefill":
        return PrefillEngine(runner, budget, options.max_prefill_tokens, options.max_prefill_batch_size)
    return DecodeEngine(runner, budget, options.max_running, options.max_prefill_tokens, options.max_prefill_batch_size)
