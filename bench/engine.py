"""Decode throughput of the worker engine vs sequential and static-batch `model.generate`, one run.

    .venv/bin/python bench/engine.py [--requests 64] [--new-tokens 64] [--concurrency 1 4 16 64]
    .venv/bin/python bench/engine.py --guided [--concurrency 16 64]
    .venv/bin/python bench/engine.py --step-overhead [--concurrency 16 64] [--repeats 3]

Builds (once, offline) a model big enough that the forward pass dominates: hidden 512, 8 layers.
The engine path is the real PrefillEngine + DecodeEngine of a worker, in one process, with the
KV cache handed from one to the other directly (the transfer has its own benchmark). `--guided`
instead runs every request under a JSON schema against the same requests unconstrained.

Every engine run also times each decode step whole and its model forward alone: the rest (sampling,
stop checks, detokenizing, the hand-off to the event loop) is the step's overhead, printed per batch
size (the steps whose batch held exactly `concurrency` sequences). `--step-overhead` prints only that.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
import uuid
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llguidance  # noqa: E402
import torch  # noqa: E402

from embedded_model import ModelSpec, build_model, default_model_dir  # noqa: E402
from kv_transfer.base import TransferredKv  # noqa: E402
from worker.torch_engine.decode_engine import DecodeEngine  # noqa: E402
from worker.engine.messages import KvLayerReady, PrefillDone  # noqa: E402
from worker.torch_engine.model_runner import ModelRunner  # noqa: E402
from worker.torch_engine.prefill_engine import PrefillEngine  # noqa: E402
from worker.engine.sequence import SamplingParams  # noqa: E402

BENCH_SPEC = ModelSpec(name="pdserve-bench-512x8", hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4)


# Objects in an array of at least 64: no request can finish (EOS) before its new tokens are out, so
# both modes decode the same number of tokens. Whitespace as the coordinator allows it by default.
GUIDED_SCHEMA = {
    "type": "array", "minItems": 64,
    "items": {"type": "object", "additionalProperties": False, "required": ["id", "name", "ok", "kind"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                             "name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"},
                             "kind": {"enum": ["alpha", "beta", "gamma"]}}},
}
GUIDED_GRAMMAR = llguidance.LLMatcher.grammar_from_json_schema(
    GUIDED_SCHEMA, overrides={"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,32}"})


def bench_model_dir() -> Path:
    out = default_model_dir().with_name(BENCH_SPEC.name)
    if not (out / "config.json").exists():
        print(f"building {BENCH_SPEC.name} into {out} ...", file=sys.stderr)
        build_model(out, BENCH_SPEC)
    return out


def make_prompts(n: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(16, 129))] for _ in range(n)]


class StepTimes:
    """Each decode step's whole time and its model forward's, by batch size, from wrappers around the
    engine's `_step` and the runner's `decode` (the engine's own code stays untouched)."""

    def __init__(self):
        self.by_batch: dict[int, list[tuple[float, float]]] = defaultdict(list)  # (step s, forward s)

    @contextmanager
    def attached(self, engine: DecodeEngine, runner: ModelRunner):
        step, decode = engine._step, runner.decode
        forward: list[float] = []

        def timed_decode(seqs):
            started = time.perf_counter()
            logits = decode(seqs)
            forward.append(time.perf_counter() - started)
            return logits

        def timed_step(batch):
            forward.clear()
            started = time.perf_counter()
            step(batch)
            if forward:  # a step that failed before its forward has nothing to split
                self.by_batch[len(batch)].append((time.perf_counter() - started, forward[0]))

        engine._step, runner.decode = timed_step, timed_decode
        try:
            yield
        finally:
            del engine._step, runner.decode  # back to the class's methods

    def summary(self, batch_size: int) -> dict[str, float] | None:
        """p50 and mean (ms) of the step, its forward and the rest, and the rest's share of the step."""
        times = self.by_batch.get(batch_size)
        if not times:
            return None
        steps = [s * 1000 for s, _ in times]
        forwards = [f * 1000 for _, f in times]
        rest = [s - f for s, f in zip(steps, forwards)]
        return {"steps": len(times), "step_p50": statistics.median(steps), "step_mean": statistics.fmean(steps),
                "forward_p50": statistics.median(forwards), "forward_mean": statistics.fmean(forwards),
                "rest_p50": statistics.median(rest), "rest_mean": statistics.fmean(rest),
                "share_p50": statistics.median(r / s for r, s in zip(rest, steps)),
                "share_mean": statistics.fmean(rest) / statistics.fmean(steps)}


def print_step_overhead(rows: list[tuple[int, dict[str, float]]]) -> None:
    print("\nDecode step time outside the model forward (sampling, stop checks, detokenizing, hand-off to the "
          "event loop; target: at most 10% of the step), over the steps whose batch held exactly `batch` "
          "sequences:\n")
    print("| batch | steps | step ms p50 / mean | forward ms p50 / mean | outside forward ms p50 / mean "
          "| share of step p50 / mean |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch, s in rows:
        print(f"| {batch} | {s['steps']} | {s['step_p50']:.2f} / {s['step_mean']:.2f} "
              f"| {s['forward_p50']:.2f} / {s['forward_mean']:.2f} | {s['rest_p50']:.2f} / {s['rest_mean']:.2f} "
              f"| {s['share_p50']:.1%} / {s['share_mean']:.1%} |")


def run_sequential(model, prompts, new_tokens) -> tuple[int, float]:
    start, total = time.perf_counter(), 0
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False)
            total += out.shape[1] - len(p)
    return total, time.perf_counter() - start


def run_static_batch(model, prompts, new_tokens, pad_id) -> tuple[int, float]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = (ids != pad_id).long()
    for row, p in enumerate(prompts):
        mask[row, width - len(p):] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=pad_id)
    return (out.shape[1] - width) * len(prompts), time.perf_counter() - start


async def run_engine(prefill_runner, decode_runner, prompts, new_tokens, concurrency,
                     grammar: str | None = None, times: StepTimes | None = None) -> tuple[int, float]:
    # Two runners, as in a deployment where prefill and decode are separate workers.
    prefill = PrefillEngine(prefill_runner, budget_tokens=10**7, max_batch_tokens=8192, max_batch_size=16)
    decode = DecodeEngine(decode_runner, budget_tokens=10**7, max_running=256)
    with (times or StepTimes()).attached(decode, decode_runner):
        return await _run_clients(prefill, decode, decode_runner, prompts, new_tokens, concurrency, grammar)


async def _run_clients(prefill, decode, decode_runner, prompts, new_tokens, concurrency,
                       grammar: str | None) -> tuple[int, float]:
    """`concurrency` clients, each sending the next pending prompt through prefill then decode until none is left."""
    prefill.start()
    decode.start()
    # EOS would end sequences early and flatter no one: every request generates exactly new_tokens.
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, grammar=grammar)
    prefill.check_sampling(params)  # compiled off the clock, as the servicers do before a request is queued
    decode.check_sampling(params)
    decode_runner.eos_token_ids = frozenset()
    pending = list(prompts)
    total = 0

    async def client():
        nonlocal total
        while pending:
            prompt = pending.pop()
            rid = uuid.uuid4().hex
            handle = decode.register(rid, len(prompt), params, 4096)
            await decode.admit(handle)
            job = await prefill.submit(rid, prompt, params)
            layers = {}
            while isinstance(event := await job.events.get(), KvLayerReady):
                layers[event.layer.index] = (event.layer.key.clone(), event.layer.value.clone())
            prefill.release(job)
            if not isinstance(event, PrefillDone):
                raise RuntimeError(event.message)
            decode.on_kv(TransferredKv(rid, [layers[i] for i in range(len(layers))], event.first_token_id,
                                       event.prefill_ms))
            while True:
                out = await handle.events.get()
                if isinstance(out, Exception):
                    raise out
                total += 1
                if out.finish_reason is not None:
                    break
            decode.release(rid)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    prefill.shutdown()
    decode.shutdown()
    return total, elapsed


def run_guided(runner, decode_runner, prompts, new_tokens, concurrencies, repeats) -> None:
    """Unconstrained and JSON-schema guided runs back to back per concurrency; the best of `repeats` each."""
    asyncio.run(run_engine(runner, decode_runner, prompts[:4], 4, 4, GUIDED_GRAMMAR))  # warm up
    rows = []
    for c in concurrencies:
        best = {}
        for _ in range(repeats):
            for mode, grammar in (("unconstrained", None), ("guided", GUIDED_GRAMMAR)):
                tokens, elapsed = asyncio.run(run_engine(runner, decode_runner, prompts, new_tokens, c, grammar))
                best[mode] = max(best.get(mode, 0.0), tokens / elapsed)
                print(f"concurrency {c} {mode}: {tokens / elapsed:.0f} tok/s", file=sys.stderr)
        rows.append((c, best["unconstrained"], best["guided"]))
    print(f"\nModel {BENCH_SPEC.name} (vocabulary {runner.vocab_size}), {len(prompts)} requests of 16-128 prompt "
          f"tokens, {new_tokens} new tokens each, greedy; guided: every request under a JSON schema "
          f"(objects in an array); best of {repeats}; torch threads {torch.get_num_threads()}.\n")
    print("| concurrency | unconstrained tokens/s | JSON-schema guided tokens/s | guided slowdown |")
    print("|---:|---:|---:|---:|")
    for c, plain, guided in rows:
        print(f"| {c} | {plain:.0f} | {guided:.0f} | {plain / guided:.2f}x |")


def run_step_overhead(runner, decode_runner, prompts, new_tokens, concurrencies, repeats) -> None:
    """Only the engine runs, `repeats` times per concurrency, pooling their steps; prints the overhead table."""
    asyncio.run(run_engine(runner, decode_runner, prompts[:4], 4, 4))  # warm up
    rows = []
    for c in concurrencies:
        times = StepTimes()
        for _ in range(repeats):
            tokens, elapsed = asyncio.run(run_engine(runner, decode_runner, prompts, new_tokens, c, times=times))
            print(f"engine concurrency {c}: {tokens / elapsed:.0f} tok/s", file=sys.stderr)
        if (summary := times.summary(c)) is not None:
            rows.append((c, summary))
    print(f"\nModel {BENCH_SPEC.name} (vocabulary {runner.vocab_size}), {len(prompts)} requests of 16-128 prompt "
          f"tokens, {new_tokens} new tokens each, greedy; {repeats} runs per batch size; "
          f"torch threads {torch.get_num_threads()}.")
    print_step_overhead(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", help="default: 1 4 16 64; with --guided, 16 64")
    parser.add_argument("--baseline-requests", type=int, default=16, help="prompts timed for the generate baselines")
    parser.add_argument("--guided", action="store_true", help="JSON-schema guided decoding against unconstrained")
    parser.add_argument("--repeats", type=int, default=2,
                        help="with --guided: runs per mode, the best one counts; with --step-overhead: runs pooled")
    parser.add_argument("--step-overhead", action="store_true",
                        help="only the decode step's time outside the model forward, at each concurrency")
    args = parser.parse_args()

    model_dir = bench_model_dir()
    runner = ModelRunner(model_dir)
    decode_runner = ModelRunner(model_dir)
    model, vocab = runner.model, runner.config.vocab_size
    prompts = make_prompts(args.requests, vocab)
    if args.guided:
        run_guided(runner, decode_runner, prompts, args.new_tokens, args.concurrency or [16, 64], args.repeats)
        return
    if args.step_overhead:
        run_step_overhead(runner, decode_runner, prompts, args.new_tokens, args.concurrency or [16, 64],
                          args.repeats)
        return
    base = prompts[: args.baseline_requests]
    pad_id = runner.tokenizer.pad_token_id

    run_sequential(model, base[:2], 4)  # warm up
    seq_tokens, seq_time = run_sequential(model, base, args.new_tokens)
    seq_tps = seq_tokens / seq_time
    print(f"sequential generate: {seq_tps:.0f} tok/s", file=sys.stderr)
    static_tokens, static_time = run_static_batch(model, base, args.new_tokens, pad_id)
    static_tps = static_tokens / static_time
    print(f"static batch generate: {static_tps:.0f} tok/s", file=sys.stderr)

    rows = [("sequential `model.generate` (baseline)", 1, seq_tps),
            (f"one static `model.generate` batch of {len(base)} (ceiling)", len(base), static_tps)]
    overhead = []
    for c in args.concurrency or [1, 4, 16, 64]:
        times = StepTimes()
        tokens, elapsed = asyncio.run(run_engine(runner, decode_runner, prompts, args.new_tokens, c, times=times))
        rows.append(("pdserve worker engine", c, tokens / elapsed))
        if (summary := times.summary(c)) is not None:
            overhead.append((c, summary))
        print(f"engine concurrency {c}: {tokens / elapsed:.0f} tok/s", file=sys.stderr)

    print(f"\nModel {BENCH_SPEC.name} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params), "
          f"{args.requests} requests of 16-128 prompt tokens, {args.new_tokens} new tokens each, "
          f"torch threads {torch.get_num_threads()}.\n")
    print("| path | concurrency | tokens/s | vs sequential | vs static batch |")
    print("|---|---:|---:|---:|---:|")
    for name, c, tps in rows:
        print(f"| {name} | {c} | {tps:.0f} | {tps / seq_tps:.2f}x | {tps / static_tps:.2f}x |")
    print_step_overhead(overhead)


if __name__ == "__main__":
    main()
