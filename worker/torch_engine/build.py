"""The real backend's engine for a worker's options: load the checkpoint, size the block pool."""

from __future__ import annotations

from worker.engine.block_pool import BlockPool
from worker.engine.kv_budget import default_capacity_tokens
from worker.engine.kv_tier import attach_tier
from worker.engine.lora import LoraResidency
from worker.engine.speculative.drafter import Drafter
from worker.torch_engine.decode_engine import DecodeEngine
from worker.torch_engine.model_runner import ModelRunner
from worker.torch_engine.peer_blocks import TorchPeerBlocks
from worker.torch_engine.prefill_engine import PrefillEngine
from worker.torch_engine.vision import PREFILL_CACHE_IMAGES


def paged_pool(runner: ModelRunner, tokens: int, block_size: int = 16, prefix_caching: bool = True,
               max_decode_rows: int = 64) -> BlockPool:
    """A block pool of about `tokens` positions, its tensors allocated on the runner's device (with the decode step
    over them, for steps of up to `max_decode_rows` rows)."""
    num_blocks = 1 + max(1, tokens // block_size)  # block 0 is the pool's zero block, and the decode step's dummy slot
    runner.allocate_cache(num_blocks, block_size, max_decode_rows)
    runner.block_pool = BlockPool(num_blocks, block_size, prefix_caching)
    return runner.block_pool


def build_engine(options, runner: ModelRunner | None = None):
    """`options` is a WorkerOptions whose backend is a ModelBackend; `runner`, the model a role switch keeps (its
    KV cache is allocated again), else the checkpoint is loaded. An encode worker's EncodeEngine loads the vision
    tower alone."""
    if options.backend.threads:
        import torch

        torch.set_num_threads(options.backend.threads)
    backend = options.backend
    if options.role == "encode":
        from worker.torch_engine.encode_engine import EncodeEngine

        return EncodeEngine(backend.model_dir, backend.dtype, backend.device, backend.encoder_cache_images,
                            options.max_encode_batch_images)
    if runner is None:
        cache_images = (PREFILL_CACHE_IMAGES if backend.encoder_cache_images is None
                        else backend.encoder_cache_images)
        runner = ModelRunner(backend.model_dir, backend.dtype, backend.device, cache_images,
                             backend.max_loras, backend.max_lora_rank, backend.attention, backend.enforce_eager)
    decoding = options.role == "decode"
    # The decode graphs' memory is kept out of the budget before it is sized; they are captured once the pool exists.
    reserved = runner.graph_reserve_bytes(options.max_running, options.block_size) if decoding else 0
    tokens = options.kv_budget_tokens or default_capacity_tokens(runner.kv_bytes_per_token(), runner.device.type,
                                                                 reserved_bytes=reserved)
    pool = paged_pool(runner, tokens, options.block_size, options.prefix_caching, options.max_running)
    if decoding:
        runner.capture_graphs()
    attach_tier(pool, options.kv_tier_dir, options.kv_tier_gb, runner.cache.block_bytes, runner.cache)
    if options.role == "prefill":
        engine = PrefillEngine(runner, pool, options.max_prefill_tokens, options.max_prefill_batch_size)
    else:
        drafter = Drafter(backend.speculative) if backend.speculative is not None else None
        engine = DecodeEngine(runner, pool, options.max_running, options.max_prefill_tokens,
                              options.max_prefill_batch_size, drafter)
    engine.peer_blocks = TorchPeerBlocks(runner)
    if runner.max_loras:
        engine.loras = LoraResidency(runner.max_loras, runner.load_lora)
    return engine
