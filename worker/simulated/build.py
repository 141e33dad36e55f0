"""The simulated backend's engine for a worker's options."""

from __future__ import annotations

from worker.engine.block_pool import BlockPool
from worker.engine.kv_tier import EmptyBlocks, attach_tier
from worker.simulated.decode_engine import SimulatedDecodeEngine
from worker.simulated.kv import SimulatedPeerBlocks
from worker.simulated.prefill_engine import SimulatedPrefillEngine


def build_engine(options, runner=None) -> SimulatedPrefillEngine | SimulatedDecodeEngine:
    """`options` is a WorkerOptions whose backend is a SimulatedBackend (there is no model: `runner` is None)."""
    sim = options.backend
    budget = options.kv_budget_tokens or sim.kv_budget_tokens
    pool = BlockPool(1 + max(1, budget // options.block_size), options.block_size, options.prefix_caching)
    attach_tier(pool, options.kv_tier_dir, options.kv_tier_gb, sim.kv_shape.kv_bytes(options.block_size),
                EmptyBlocks())
    if options.role == "prefill":
        engine = SimulatedPrefillEngine(sim.cost, sim.kv_shape, pool, options.max_prefill_tokens,
                                        options.max_prefill_batch_size, sim.vocab_size)
    else:
        engine = SimulatedDecodeEngine(sim.cost, pool, options.max_running, options.max_prefill_tokens,
                                       options.max_prefill_batch_size, sim.vocab_size)
    engine.peer_blocks = SimulatedPeerBlocks(sim.kv_shape)
    return engine
