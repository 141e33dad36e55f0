"""The simulated backend's engine for a worker's options."""

from __future__ import annotations

from worker.simulated.decode_engine import SimulatedDecodeEngine
from worker.simulated.prefill_engine import SimulatedPrefillEngine


def build_engine(options) -> SimulatedPrefillEngine | SimulatedDecodeEngine:
    """`options` is a WorkerOptions whose backend is a SimulatedBackend."""
    sim = options.backend
    budget = options.kv_budget_tokens or sim.kv_budget_tokens
    if options.role == "prefill":
        return SimulatedPrefillEngine(sim.cost, sim.kv_shape, budget, options.max_prefill_tokens,
                                      options.max_prefill_batch_size, sim.vocab_size)
    return SimulatedDecodeEngine(sim.cost, budget, options.max_running, options.max_prefill_tokens,
                                 options.max_prefill_batch_size, sim.vocab_size)
