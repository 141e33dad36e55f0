"""`pdserve worker --simulate`: its flags, and the simulated backend they describe (no torch imported)."""

from __future__ import annotations

import argparse

SIMULATED_DTYPE_AUTO = "float16"  # what a served model's KV cache is on an accelerator


def add_simulation_flags(p: argparse.ArgumentParser) -> None:
    """The --simulate switch and the cost model and model shape it runs with."""
    p.add_argument("--simulate", action="store_true",
                   help="no model: the same gRPC protocol and KV streams, timed by a cost model, synthetic tokens "
                        "(--model is ignored; --kv-budget-tokens defaults to 1048576)")
    p.add_argument("--sim-prefill-base-ms", type=float, default=1.0, help="simulate: fixed cost of a prefill forward")
    p.add_argument("--sim-prefill-ms-per-token", type=float, default=0.02,
                   help="simulate: prefill cost per (padded) prompt token")
    p.add_argument("--sim-decode-base-ms", type=float, default=5.0, help="simulate: fixed cost of a decode step")
    p.add_argument("--sim-decode-ms-per-seq", type=float, default=0.05,
                   help="simulate: decode step cost per running sequence")
    p.add_argument("--sim-tier-load-ms-per-block", type=float, default=0.01,
                   help="simulate: cost of loading one KV block from the tier (--kv-tier-gb) instead of computing it")
    p.add_argument("--sim-layers", type=int, default=2, help="simulate: model layers (KV stream size)")
    p.add_argument("--sim-kv-heads", type=int, default=2, help="simulate: KV heads (KV stream size)")
    p.add_argument("--sim-head-dim", type=int, default=32, help="simulate: head dimension (KV stream size)")
    p.add_argument("--sim-vocab-size", type=int, default=32000, help="simulate: synthetic token ids are below this")


def simulated_backend(args: argparse.Namespace):
    """The SimulatedBackend the --sim-* flags describe; ValueError names a flag value out of range."""
    from worker.service.options import SimulatedBackend
    from worker.simulated.cost_model import CostModel, KvShape

    cost = CostModel(prefill_base_ms=args.sim_prefill_base_ms, prefill_per_token_ms=args.sim_prefill_ms_per_token,
                     decode_base_ms=args.sim_decode_base_ms, decode_per_seq_ms=args.sim_decode_ms_per_seq,
                     tier_load_per_block_ms=args.sim_tier_load_ms_per_block)
    shape = KvShape(num_layers=args.sim_layers, kv_heads=args.sim_kv_heads, head_dim=args.sim_head_dim,
                    dtype=SIMULATED_DTYPE_AUTO if args.dtype == "auto" else args.dtype)
    return SimulatedBackend(cost=cost, kv_shape=shape, vocab_size=args.sim_vocab_size)
