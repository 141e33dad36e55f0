"""The decode step on a GPU: captured against eager, step times, and the engine against transformers' continuous
batching, in one run per part.

    python bench/decode_graphs.py parity --model DIR [--dtype float32] [--device cuda]
    python bench/decode_graphs.py steps --model DIR --dtype bfloat16 [--rows 1 8 16 32 64]
    python bench/decode_graphs.py throughput --model DIR --dtype bfloat16 [--concurrency 16 64]

parity: greedy tokens of the captured step (graphs) against the same padded step run eagerly and against the packed
step (no buckets), at batches of 3, 13 and 63 prompts and for one prompt at the context limit; exits 1 when graph
and eager differ (they replay the same kernels: they must not). On a machine with no CUDA device the graph column
is the eager one and says so.
steps: one decode step's time at each row count (CUDA events around the replay alone, and the same step eager),
the host's time per step outside the replay (writing the buffers, launching, the logits' copy), and the capture's
cost (graphs, seconds, memory).
throughput: bench/engine.py's engine (the real PrefillEngine + DecodeEngine) with graphs and eager, beside
transformers' continuous batching (`generate_batch`, CUDA graphs on) on the same prompts: tokens/s and ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.engine import BLOCK_SIZE, make_prompts, run_engine, synchronize  # noqa: E402
from worker.engine.block_pool import BlockTable  # noqa: E402
from worker.torch_engine.build import paged_pool  # noqa: E402
from worker.torch_engine.decode_graphs import graphs_refusal  # noqa: E402
from worker.torch_engine.model_runner import DecodeRow, ModelRunner, PromptChunk  # noqa: E402
from worker.torch_engine.model_support import DTYPES, resolve_device  # noqa: E402

MAX_ROWS = 64


def graph_runner(args, enforce_eager: bool = False) -> ModelRunner:
    """A runner whose decode steps are padded to buckets (captured where it can be), its pool made."""
    runner = ModelRunner(args.model, args.dtype, args.device, max_loras=0, enforce_eager=enforce_eager,
                         pad_decode_steps=True)
    paged_pool(runner, args.pool_tokens, BLOCK_SIZE, prefix_caching=False, max_decode_rows=MAX_ROWS)
    report = runner.capture_graphs()
    if report is not None:
        print(f"captured {report.graphs} graphs in {report.seconds:.1f} s, {report.pool_bytes / 2**20:.0f} MiB",
              file=sys.stderr)
    return runner


def greedy(runner: ModelRunner, prompts: list[list[int]], steps: int, mode: str) -> list[list[int]]:
    """Each prompt's greedy tokens, the prompts prefilled together then decoded together: `graph` (the captured
    step), `eager` (the same padded step, not replayed) or `packed` (no decode step)."""
    step, graphs = runner.decode_step, runner.decode_step.graphs
    step.graphs = graphs if mode == "graph" else None
    if mode == "packed":
        runner.decode_step = None
    tables = [BlockTable() for _ in prompts]
    try:
        for table, prompt in zip(tables, prompts):
            if not runner.block_pool.grow(table, len(prompt) + steps):
                raise RuntimeError("the pool is too small for the prompts: raise --pool-tokens")
        chunks = [PromptChunk(p, 0, t, True) for p, t in zip(prompts, tables)]
        outputs = [[token] for token in runner.forward([], chunks).argmax(-1).tolist()]
        for _ in range(steps - 1):
            rows = [DecodeRow(out[-1], len(p) + len(out) - 1, t) for p, t, out in zip(prompts, tables, outputs)]
            for out, token in zip(outputs, runner.forward(rows, []).argmax(-1).tolist()):
                out.append(token)
        return outputs
    finally:
        runner.decode_step, step.graphs = step, graphs
        for table in tables:
            runner.block_pool.release(table)


def run_parity(args) -> int:
    runner = graph_runner(args)
    reason = graphs_refusal(runner.device, False)
    vocab = runner.vocab_size
    rng = random.Random(1)
    cases = [(f"batch {n}", [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 200))] for _ in range(n)])
             for n in (3, 13, 63)]
    limit = runner.max_context - args.new_tokens  # its last token lands on the last position
    cases.append((f"one prompt of {limit} (context limit {runner.max_context})",
                  [[rng.randrange(3, vocab) for _ in range(limit)]]))
    print(f"\nGreedy tokens, {args.new_tokens} per prompt, {runner.model_dir.name} "
          f"({str(runner.dtype).removeprefix('torch.')}) on {runner.device}"
          + (f"; no graphs here ({reason}): the graph column ran eagerly" if reason else "") + ".\n")
    print("| case | graph = eager (padded) | graph = packed |")
    print("|---|---:|---:|")
    failed = 0
    for name, prompts in cases:
        got = {mode: greedy(runner, prompts, args.new_tokens, mode) for mode in ("graph", "eager", "packed")}
        same_eager = sum(a == b for a, b in zip(got["graph"], got["eager"]))
        same_packed = sum(a == b for a, b in zip(got["graph"], got["packed"]))
        failed += same_eager != len(prompts)
        print(f"| {name} | {same_eager}/{len(prompts)} | {same_packed}/{len(prompts)} |")
    return 1 if failed else 0


def timed_ms(device: torch.device, fn, repeats: int) -> float:
    """Median ms of `fn()` by CUDA events on a GPU (the device's time), else by the host's clock."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def run_steps(args) -> int:
    runner = graph_runner(args)
    step, device = runner.decode_step, runner.device
    report = step.graphs.report if step.graphs is not None else None
    rng = random.Random(2)
    pool = runner.block_pool
    tables = []
    for _ in range(max(args.rows)):
        table = BlockTable()
        pool.grow(table, args.context + 1)
        tables.append(table)
    for t in runner.cache.keys + runner.cache.values:  # the step's cost does not depend on the values
        t.normal_(0, 0.5)
    results = []
    with torch.inference_mode():
        for n in args.rows:
            rows = [DecodeRow(rng.randrange(3, runner.vocab_size), args.context, t) for t in tables[:n]]
            size, width, lora = step.prepare(rows)
            captured = step.graphs is not None and (size, width) in step.graphs
            replay = timed_ms(device, (lambda: step.graphs.replay(size, width)) if captured
                              else (lambda: step.forward(size, width, lora)), args.repeats)
            graphs, step.graphs = step.graphs, None
            eager = timed_ms(device, lambda: step.forward(size, width, lora), args.repeats)
            step.graphs = graphs
            host = []
            for _ in range(args.repeats):
                synchronize(device)
                started = time.perf_counter()
                runner.forward(rows, [])  # buffers written, copies and replay launched, logits' copy queued
                host.append((time.perf_counter() - started) * 1000)
            synchronize(device)
            results.append((n, size, width, captured, replay, eager, statistics.median(host)))
    print(f"\nOne decode step, {runner.model_dir.name} ({str(runner.dtype).removeprefix('torch.')}) on {device}, "
          f"context {args.context}, median of {args.repeats}"
          + (f"; {report.graphs} graphs captured in {report.seconds:.1f} s, {report.pool_bytes / 2**20:.0f} MiB"
             if report else f"; no graphs ({graphs_refusal(device, False)})") + ".\n")
    print("| rows | bucket | context blocks | replayed | step ms | eager ms | eager / step | host ms per step |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|")
    for n, size, width, captured, replay, eager, host in results:
        print(f"| {n} | {size} | {width} | {'yes' if captured else 'no'} | {replay:.2f} | {eager:.2f} "
              f"| {eager / replay:.2f}x | {host:.2f} |")
    by_rows = {n: replay for n, _, _, _, replay, _, _ in results}
    if 8 in by_rows and 64 in by_rows:
        print(f"\nstep at 64 rows / step at 8 rows: {by_rows[64] / by_rows[8]:.2f}x")
    return 0


def transformers_cb(model_dir: Path, dtype: str, device: torch.device, prompts, new_tokens: int, concurrency: int,
                    cuda_graphs: bool) -> float:
    """tokens/s of transformers' continuous batching (`generate_batch`) over the prompts, `concurrency` requests per
    batch at most; the second of two runs of one manager (the first captures its graphs). RuntimeError unless every
    token came (it logs its own failures and returns what finished)."""
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    kwargs = {} if dtype == "auto" else {"dtype": DTYPES[dtype]}
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).to(device).eval()
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    # Its attention as loaded (SDPA): switching to flash looks for kernels on the Hub, which the machine cannot reach.
    batching = ContinuousBatchingConfig(use_cuda_graph=cuda_graphs, max_requests_per_batch=concurrency,
                                        auto_switch_to_flash=False)
    rate = 0.0
    try:
        for _ in range(2):
            synchronize(device)
            started = time.perf_counter()
            out = model.generate_batch(prompts, config, continuous_batching_config=batching, persistent_manager=True)
            synchronize(device)
            tokens = sum(len(o.generated_tokens) for o in out.values())
            if tokens != len(prompts) * new_tokens:
                raise RuntimeError(f"{tokens} of {len(prompts) * new_tokens} tokens came (see its log)")
            rate = tokens / (time.perf_counter() - started)
    finally:
        model.destroy_cached_continuous_batching_manager()
    return rate


def run_throughput(args) -> int:
    device = resolve_device(args.device)
    prompts = make_prompts(args.requests, ModelRunner(args.model, args.dtype, args.device).vocab_size)
    rows = []
    for c in args.concurrency:
        rates = {}
        for label, eager in (("graphs", False), ("eager", True)):
            prefill = ModelRunner(args.model, args.dtype, args.device, max_loras=0)
            decode = ModelRunner(args.model, args.dtype, args.device, max_loras=0, enforce_eager=eager)
            asyncio.run(run_engine(prefill, decode, prompts[:4], 4, 4))  # warm up
            rates[label] = asyncio.run(run_engine(prefill, decode, prompts, args.new_tokens, c)).tokens_per_s
            print(f"engine {label} at {c}: {rates[label]:.0f} tok/s", file=sys.stderr)
            del prefill, decode
        try:
            rates["cb"] = transformers_cb(args.model, args.dtype, device, prompts, args.new_tokens, c,
                                          device.type == "cuda")
        except Exception as exc:  # noqa: BLE001 (the baseline's own failure is reported, the table still prints)
            print(f"transformers continuous batching failed at {c}: {exc!r}", file=sys.stderr)
            rates["cb"] = float("nan")
        rows.append((c, rates))
    reason = graphs_refusal(device, False)
    print(f"\n{args.requests} requests, {args.new_tokens} new tokens each (no EOS), {args.model.name} "
          f"({args.dtype}) on {device}; transformers' continuous batching with CUDA graphs where there is CUDA"
          + (f"; no graphs here ({reason}): both pdserve columns ran eagerly" if reason else "") + ".\n")
    print("| streams | pdserve graphs tok/s | pdserve eager tok/s | transformers CB tok/s | graphs / eager "
          "| graphs / CB |")
    print("|---:|---:|---:|---:|---:|---:|")
    for c, r in rows:
        print(f"| {c} | {r['graphs']:.0f} | {r['eager']:.0f} | {r['cb']:.0f} | {r['graphs'] / r['eager']:.2f}x "
              f"| {r['graphs'] / r['cb']:.2f}x |")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("parity", "steps", "throughput"))
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--device", default="auto", help="auto (CUDA if any, else cpu), cpu or cuda[:N]")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    parser.add_argument("--new-tokens", type=int, default=16, help="parity: tokens per prompt; throughput: 64")
    parser.add_argument("--pool-tokens", type=int, default=65_536, help="parity and steps: the pool's positions")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64], help="steps: rows per step")
    parser.add_argument("--context", type=int, default=200, help="steps: every row's position")
    parser.add_argument("--repeats", type=int, default=20, help="steps: timings per point")
    parser.add_argument("--requests", type=int, default=64, help="throughput: prompts")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64], help="throughput: streams")
    args = parser.parse_args()
    if args.part == "throughput" and args.new_tokens == 16:
        args.new_tokens = 64
    sys.exit({"parity": run_parity, "steps": run_steps, "throughput": run_throughput}[args.part](args))


if __name__ == "__main__":
    main()
