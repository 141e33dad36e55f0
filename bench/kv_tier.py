"""What a KV tier block costs: written when the pool evicts it, loaded back into the pool, in the checkpoint's
own KV shape (the model is not loaded: the cost depends on the block's bytes alone).

    .venv/bin/python bench/kv_tier.py [--model DIR] [--blocks 256] [--dtype float32] [--dir DIR]

A pool of `--blocks` blocks is filled and registered as one prompt, then evicted whole into a tier in `--dir`
(default: a temp folder on the local disk) by a second prompt; the tier's writer is waited for; then the first
prompt is looked up again and every block comes back from the tier (read, xxh3 checked, written into the pool).
Prints the eviction's cost on the caller's path (the copy out), the writer's, and the load per block; compare
with computing a block (16 positions) on the same machine (bench/kv_pull.py's cold TTFT per block).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from bench.serving import DEFAULT_MODEL  # noqa: E402
from worker.engine.block_pool import BlockPool, BlockTable  # noqa: E402
from worker.engine.kv_tier import KvTier  # noqa: E402
from worker.torch_engine.kv_cache import KvCache  # noqa: E402

BS = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--dir", type=Path, default=None)
    args = p.parse_args()
    config = AutoConfig.from_pretrained(args.model)
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = KvCache(config.num_hidden_layers, args.blocks + 1, BS, heads, head_dim, DTYPES[args.dtype],
                    torch.device("cpu"))
    for t in cache.keys + cache.values:
        t.normal_()
    pool = BlockPool(args.blocks + 1, BS)
    directory = args.dir or Path(tempfile.mkdtemp(prefix="pdserve-kv-tier-"))
    tier = KvTier(directory, args.blocks, cache.block_bytes, BS)
    pool.attach_tier(tier, cache)
    first, second = list(range(1000, 1000 + args.blocks * BS)), list(range(50000, 50000 + args.blocks * BS))
    table = BlockTable()
    pool.grow(table, len(first))
    pool.register(table, first, len(first))
    pool.release(table)

    started = time.perf_counter()
    table = BlockTable()
    pool.grow(table, len(second))  # evicts every block of the first prompt: each copied out here
    evict_s = time.perf_counter() - started
    tier.flush()
    written_s = time.perf_counter() - started
    pool.release(table)  # second's blocks are not registered: they go free, and the lookup below takes them

    started = time.perf_counter()
    found = pool.cached_prefix(first + [1], len(first), BlockTable())
    load_s = time.perf_counter() - started
    tier.close()
    if found != len(first):
        print(f"only {found} of {len(first)} positions came back from the tier", file=sys.stderr)
        return 1
    mb = cache.block_bytes / 1e6
    print(f"\nbench/kv_tier.py: `{Path(args.model).name}`'s KV shape ({config.num_hidden_layers} layers, {heads} KV "
          f"heads x {head_dim}, {args.dtype}): {cache.block_bytes / 1024:.0f} KiB per {BS}-position block, "
          f"{args.blocks} blocks, tier in `{directory}`\n")
    print("| step | ms per block | MB/s |")
    print("|---|---:|---:|")
    for name, seconds in (("evicted: bytes copied out (on the pool's caller)", evict_s),
                          ("written to the tier (background writer, xxh3)", written_s),
                          ("loaded back: read, checked, written into the pool", load_s)):
        per = seconds / args.blocks
        print(f"| {name} | {per * 1000:.3f} | {mb / per:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
