"""Decode throughput and TTFT of the worker engine vs sequential and static-batch `model.generate`, one run.

    .venv/bin/python bench/engine.py [--requests 64] [--new-tokens 64] [--concurrency 1 4 16 64]
    .venv/bin/python bench/engine.py --guided [--concurrency 16 64]
    .venv/bin/python bench/engine.py --step-overhead [--concurrency 16 64] [--repeats 3]
    .venv/bin/python bench/engine.py --context-steps [--contexts 256 2048] [--rows 64]
    .venv/bin/python bench/engine.py --parity --dtype float32 [--requests 16] [--device cuda]
    .venv/bin/python bench/engine.py --device cuda --model /path/SmolLM2-135M-Instruct --dtype bfloat16 \
        --concurrency 16 64

By default it builds (once, offline) a model big enough that the forward pass dominates: hidden 512,
8 layers; `--model DIR` measures a checkpoint instead. `--device` (auto: the first CUDA device if there
is one, else the CPU) and `--dtype` apply to the engine and the baselines alike.

The engine path is the real PrefillEngine + DecodeEngine of a worker, in one process, each with its own
runner and paged block pool (sized so that nothing is preempted), with the KV cache handed from one to
the other directly as the prefill engine streams it out, layer by layer (on CUDA through the pinned host
copies it makes for sending; the transfer itself has its own benchmark). The baselines load the
checkpoint again with transformers' own attention (the engine's model attends over its block pool).
TTFT is the time from a client's submission (register on the decode engine) to its first token, p50
over the run's requests. `--guided` instead runs every request under a JSON schema against the same
requests unconstrained.

Every engine run also times each decode step whole and its model forward alone (on CUDA, up to the
forward's kernels finishing): the rest (sampling, stop checks, detokenizing, the hand-off to the event
loop) is the step's overhead, printed per batch size (the decode-only steps whose batch held exactly
`concurrency` sequences). `--step-overhead` prints only that. On CUDA the decode steps are captured as graphs
(bucketed to `concurrency` rows, at the start of each run, off the clock) unless `--enforce-eager`.

`--context-steps` times one decode step of `--rows` sequences at each context length, with each attention path
(the engine's paged kernel and the torch reference that gathers blocks), the contexts distinct per row or all
but the last block shared (a system prompt): the kernel reads the blocks where they lie, and a shared prefix once.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import sys
import time
import uuid
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llguidance  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from embedded_model import ModelSpec, build_model, default_model_dir  # noqa: E402
from kv_transfer.base import TransferredKv  # noqa: E402
from worker.engine.messages import KvLayerReady, PrefillDone  # noqa: E402
from worker.engine.sequence import SamplingParams  # noqa: E402
from worker.engine.block_pool import BlockTable  # noqa: E402
from worker.torch_engine.build import paged_pool  # noqa: E402
from worker.torch_engine.decode_engine import DecodeEngine  # noqa: E402
from worker.torch_engine.model_runner import DecodeRow, ModelRunner  # noqa: E402
from worker.torch_engine.model_support import DTYPES, resolve_device  # noqa: E402
from worker.torch_engine.prefill_engine import PrefillEngine  # noqa: E402

BENCH_SPEC = ModelSpec(name="pdserve-bench-512x8", hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4)
MIN_PROMPT, MAX_PROMPT = 16, 128  # prompt lengths, in tokens
BLOCK_SIZE = 16  # the workers' default


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
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(MIN_PROMPT, MAX_PROMPT + 1))] for _ in range(n)]


def check_on_device(model: torch.nn.Module, device: torch.device) -> None:
    """Refuse to time a model any of whose weights are elsewhere (a CUDA run must not do CPU work)."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.device.type != device.type or (device.index is not None and tensor.device.index != device.index):
            raise RuntimeError(f"{name} is on {tensor.device}, not on {device}")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu, torch threads {torch.get_num_threads()}"


@dataclass
class EngineRun:
    tokens: int
    elapsed: float
    ttfts: list[float]  # seconds from each request's submission to its first token
    outputs: dict[int, list[int]]  # each prompt's (by index) generated token ids

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed

    @property
    def ttft_p50_ms(self) -> float:
        return statistics.median(self.ttfts) * 1000


class StepTimes:
    """Each decode step's whole time and its model forward's, by batch size, from wrappers around the
    engine's `_step(batch, chunks)` and the decode runner's `forward` (the engine's own code stays untouched).
    Only decode-only steps count (one with prompt chunks, a preempted sequence's recomputation, is left out).
    On CUDA the forward is timed to its kernels' end (a synchronize), else its kernels would finish
    in the sampling that follows and count as overhead."""

    def __init__(self):
        self.by_batch: dict[int, list[tuple[float, float]]] = defaultdict(list)  # (step s, forward s)

    @contextmanager
    def attached(self, engine: DecodeEngine, runner: ModelRunner):
        step, forward = engine._step, runner.forward
        device = runner.device
        forward_s: list[float] = []

        def timed_forward(decode, chunks, on_layer=None):
            started = time.perf_counter()
            logits = forward(decode, chunks, on_layer)
            synchronize(device)
            forward_s.append(time.perf_counter() - started)
            return logits

        def timed_step(batch, chunks):
            forward_s.clear()
            started = time.perf_counter()
            step(batch, chunks)
            if forward_s and not chunks:  # a step that failed before its forward has nothing to split
                self.by_batch[len(batch)].append((time.perf_counter() - started, forward_s[0]))

        engine._step, runner.forward = timed_step, timed_forward
        try:
            yield
        finally:
            del engine._step, runner.forward  # back to the classes' methods

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


# baselines ---------------------------------------------------------------------------------------
def load_baseline(model_dir: Path, dtype: str, device: torch.device):
    """The checkpoint as transformers loads it (its own attention), on `device`, in the engine's dtype."""
    kwargs = {} if dtype == "auto" else {"dtype": DTYPES[dtype]}
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).to(device).eval()
    check_on_device(model, device)
    return model


def run_sequential(model, prompts, new_tokens, pad_id, device) -> tuple[int, float]:
    synchronize(device)
    start, total = time.perf_counter(), 0
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
            total += out.shape[1] - len(p)
    synchronize(device)
    return total, time.perf_counter() - start


def run_static_batch(model, prompts, new_tokens, pad_id, device) -> tuple[int, float]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=device)
    synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=pad_id)
    synchronize(device)
    return (out.shape[1] - width) * len(prompts), time.perf_counter() - start


# the engine --------------------------------------------------------------------------------------
def pool_tokens(prompts, new_tokens, concurrency) -> int:
    """Positions for every sequence a run holds at once (`concurrency` of the longest), so none is preempted."""
    longest = max(len(p) for p in prompts) + new_tokens + 1
    return min(concurrency, len(prompts)) * (-(-longest // BLOCK_SIZE) + 1) * BLOCK_SIZE


async def run_engine(prefill_runner, decode_runner, prompts, new_tokens, concurrency,
                     grammar: str | None = None, times: StepTimes | None = None) -> EngineRun:
    # Two runners, as in a deployment where prefill and decode are separate workers; fresh pools every run, so no
    # run finds the prompts of the one before in a prefix cache.
    tokens = pool_tokens(prompts, new_tokens, concurrency)
    prefill = PrefillEngine(prefill_runner, paged_pool(prefill_runner, tokens, BLOCK_SIZE),
                            max_batch_tokens=8192, max_batch_size=16)
    decode = DecodeEngine(decode_runner, paged_pool(decode_runner, tokens, BLOCK_SIZE, max_decode_rows=concurrency),
                          max_running=256)
    decode_runner.capture_graphs()  # as a decode worker does once its pool is made (CUDA, unless --enforce-eager)
    with (times or StepTimes()).attached(decode, decode_runner):
        run = await _run_clients(prefill, decode, decode_runner, prompts, new_tokens, concurrency, grammar)
    if decode.scheduler.num_preemptions:
        print(f"warning: {decode.scheduler.num_preemptions} preemptions (the decode pool ran out of blocks)",
              file=sys.stderr)
    return run


async def _run_clients(prefill, decode, decode_runner, prompts, new_tokens, concurrency,
                       grammar: str | None) -> EngineRun:
    """`concurrency` clients, each sending the next pending prompt through prefill then decode until none is left,
    as the servicers do: register and admit on the decode engine, hold its cached prefix, prefill the rest."""
    prefill.start()
    decode.start()
    # EOS would end sequences early and flatter no one: every request generates exactly new_tokens.
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, grammar=grammar)
    prefill.check_sampling(params)  # compiled off the clock, as the servicers do before a request is queued
    decode.check_sampling(params)
    decode_runner.eos_token_ids = frozenset()
    max_seq_len = getattr(decode_runner.config, "max_position_embeddings", None) or 4096
    pending = list(enumerate(prompts))
    total = 0
    ttfts: list[float] = []
    outputs: dict[int, list[int]] = {}

    async def client():
        nonlocal total
        while pending:
            index, prompt = pending.pop()
            outputs[index] = tokens = []
            rid = uuid.uuid4().hex
            submitted = time.perf_counter()
            handle = decode.register(rid, len(prompt), params, max_seq_len, prompt)
            await decode.admit(handle)
            cached = decode.hold_cached_prefix(handle)
            job = await prefill.submit(rid, prompt, params, skip_tokens=cached)
            layers = {}
            try:
                # The engine reads each layer out of its pool into fresh tensors: they are ours to keep.
                while isinstance(event := await job.events.get(), KvLayerReady):
                    layers[event.layer.index] = (event.layer.key, event.layer.value)
            finally:
                prefill.release(job)
            if not isinstance(event, PrefillDone):
                raise RuntimeError(event.message)
            decode.on_kv(TransferredKv(rid, [layers[i] for i in range(len(layers))], event.first_token_id,
                                       event.prefill_ms, first_position=cached))
            first = True
            try:
                while True:
                    out = await handle.events.get()
                    if isinstance(out, Exception):
                        raise out
                    if first:
                        ttfts.append(time.perf_counter() - submitted)
                        first = False
                    total += 1
                    tokens.append(out.token_id)
                    if out.finish_reason is not None:
                        break
            finally:
                decode.release(rid)

    try:
        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    finally:
        prefill.shutdown()
        decode.shutdown()
    return EngineRun(total, elapsed, ttfts, outputs)


def describe(args, model_name: str, runner: ModelRunner) -> str:
    return (f"Model {model_name} ({sum(p.numel() for p in runner.model.parameters()) / 1e6:.1f} M params, "
            f"{str(runner.dtype).removeprefix('torch.')}, vocabulary {runner.vocab_size}) on "
            f"{device_label(runner.device)}, {args.requests} requests of {MIN_PROMPT}-{MAX_PROMPT} prompt tokens, "
            f"{args.new_tokens} new tokens each, greedy")


def run_guided(args, model_name, runner, decode_runner, prompts, concurrencies) -> None:
    """Unconstrained and JSON-schema guided runs back to back per concurrency; the best of `repeats` each."""
    asyncio.run(run_engine(runner, decode_runner, prompts[:4], 4, 4, GUIDED_GRAMMAR))  # warm up
    rows = []
    for c in concurrencies:
        best = {}
        for _ in range(args.repeats):
            for mode, grammar in (("unconstrained", None), ("guided", GUIDED_GRAMMAR)):
                run = asyncio.run(run_engine(runner, decode_runner, prompts, args.new_tokens, c, grammar))
                best[mode] = max(best.get(mode, 0.0), run.tokens_per_s)
                print(f"concurrency {c} {mode}: {run.tokens_per_s:.0f} tok/s, TTFT p50 {run.ttft_p50_ms:.1f} ms",
                      file=sys.stderr)
        rows.append((c, best["unconstrained"], best["guided"]))
    print(f"\n{describe(args, model_name, runner)}; guided: every request under a JSON schema (objects in an array); "
          f"best of {args.repeats}.\n")
    print("| concurrency | unconstrained tokens/s | JSON-schema guided tokens/s | guided slowdown |")
    print("|---:|---:|---:|---:|")
    for c, plain, guided in rows:
        print(f"| {c} | {plain:.0f} | {guided:.0f} | {plain / guided:.2f}x |")


def run_step_overhead(args, model_name, runner, decode_runner, prompts, concurrencies) -> None:
    """Only the engine runs, `repeats` times per concurrency, pooling their steps; prints the overhead table."""
    asyncio.run(run_engine(runner, decode_runner, prompts[:4], 4, 4))  # warm up
    rows = []
    for c in concurrencies:
        times = StepTimes()
        for _ in range(args.repeats):
            run = asyncio.run(run_engine(runner, decode_runner, prompts, args.new_tokens, c, times=times))
            print(f"engine concurrency {c}: {run.tokens_per_s:.0f} tok/s, TTFT p50 {run.ttft_p50_ms:.1f} ms",
                  file=sys.stderr)
        if (summary := times.summary(c)) is not None:
            rows.append((c, summary))
    print(f"\n{describe(args, model_name, runner)}; {args.repeats} runs per batch size.")
    print_step_overhead(rows)


def context_step_ms(runner: ModelRunner, rows: int, context: int, shared: bool, steps: int) -> float:
    """Median time of a decode step of `rows` sequences at `context` positions over a pool of random keys and
    values (the step's cost does not depend on them); `shared`: every row holds the same leading blocks."""
    blocks = context // BLOCK_SIZE + 1
    own = 1 if shared else blocks
    paged_pool(runner, ((blocks - own) + rows * own + 1) * BLOCK_SIZE, BLOCK_SIZE, prefix_caching=False)
    for t in runner.cache.keys + runner.cache.values:
        t.normal_(0, 0.5)
    ids = iter(range(1, runner.block_pool.num_blocks))
    common = [next(ids) for _ in range(blocks - own)]
    decode = [DecodeRow(7, context, BlockTable(common + [next(ids) for _ in range(own)])) for _ in range(rows)]
    times = []
    for i in range(steps + 2):
        synchronize(runner.device)
        started = time.perf_counter()
        runner.forward(decode, [])
        synchronize(runner.device)
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def run_context_steps(args, model_name, model_dir: Path) -> None:
    """A decode step's time by context length, layout and attention path; prints the table. The kernel is the
    CPU's, so on a GPU only the torch path is timed (its column stands in the kernel's)."""
    paths = ("kernel", "torch") if resolve_device(args.device).type == "cpu" else ("torch",)
    runners = {name: ModelRunner(model_dir, args.dtype, args.device, attention=name) for name in paths}
    results = {}
    for layout in ("distinct", "shared"):
        for context in args.contexts:
            for name, runner in runners.items():
                ms = context_step_ms(runner, args.rows, context, layout == "shared", args.steps)
                results[layout, context, name] = ms
                print(f"{layout} context {context} {name}: {ms:.1f} ms/step", file=sys.stderr)
                runner.release_cache()
                gc.collect()
    runner = runners[paths[0]]
    if len(paths) == 1:
        results.update({(layout, context, "kernel"): ms for (layout, context, _), ms in list(results.items())})
    first = args.contexts[0]
    print(f"\nModel {model_name} ({str(runner.dtype).removeprefix('torch.')}) on {device_label(runner.device)}: one "
          f"decode step of {args.rows} rows (no prompt chunks), median of {args.steps}; shared: all rows hold the "
          f"same blocks but their last.\n")
    print(f"| context | contexts | kernel ms/step | torch (gather) ms/step | kernel vs torch | kernel vs {first} |")
    print("|---:|---|---:|---:|---:|---:|")
    for layout in ("distinct", "shared"):
        for context in args.contexts:
            kernel, gather = results[layout, context, "kernel"], results[layout, context, "torch"]
            print(f"| {context} | {layout} | {kernel:.1f} | {gather:.1f} | {gather / kernel:.2f}x faster "
                  f"| {kernel / results[layout, first, 'kernel']:.2f}x |")


def run_parity(args, model_dir: Path, device: torch.device, runner, decode_runner, prompts) -> None:
    """Greedy tokens of the engine (at `concurrency` 4, so rows batch) against `model.generate` one prompt at a
    time; exits 1 on any difference. Meant for float32: two attention paths in bfloat16 may round apart."""
    model = load_baseline(model_dir, args.dtype, device)
    expected = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
            expected.append(out[0, len(p):].tolist())
    del model
    run = asyncio.run(run_engine(runner, decode_runner, prompts, args.new_tokens, 4))
    same = sum(run.outputs[i] == want for i, want in enumerate(expected))
    print(f"parity on {device_label(device)}, {str(runner.dtype).removeprefix('torch.')}: {same}/{len(prompts)} "
          f"prompts' {args.new_tokens} greedy tokens identical to model.generate")
    if same != len(prompts):
        sys.exit(1)


def run_baselines(model_dir: Path, dtype: str, device: torch.device, base, new_tokens) -> tuple[float, float]:
    """tokens/s of sequential and of one static batch of `model.generate`; the model is freed after."""
    model = load_baseline(model_dir, dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad_id = next((i for i in (tokenizer.pad_token_id, model.generation_config.pad_token_id, tokenizer.eos_token_id)
                   if isinstance(i, int)), 0)
    run_sequential(model, base[:2], 4, pad_id, device)  # warm up
    seq_tokens, seq_time = run_sequential(model, base, new_tokens, pad_id, device)
    print(f"sequential generate: {seq_tokens / seq_time:.0f} tok/s", file=sys.stderr)
    run_static_batch(model, base[:2], 4, pad_id, device)  # warm up
    static_tokens, static_time = run_static_batch(model, base, new_tokens, pad_id, device)
    print(f"static batch generate: {static_tokens / static_time:.0f} tok/s", file=sys.stderr)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return seq_tokens / seq_time, static_tokens / static_time


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
    parser.add_argument("--parity", action="store_true",
                        help="greedy tokens of the engine against model.generate, per prompt (exit 1 if any differ)")
    parser.add_argument("--context-steps", action="store_true",
                        help="one decode step's time by context length, kernel against the torch reference")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048], help="with --context-steps")
    parser.add_argument("--rows", type=int, default=64, help="with --context-steps: sequences per step")
    parser.add_argument("--steps", type=int, default=10, help="with --context-steps: steps timed per point")
    parser.add_argument("--model", type=Path, help=f"checkpoint directory (default: the built {BENCH_SPEC.name})")
    parser.add_argument("--device", default="auto",
                        help="auto (the first CUDA device if any, else cpu), cpu or cuda[:N]; the baselines too")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="auto: as the checkpoint loads")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="decode steps run eagerly (on CUDA they are otherwise captured as graphs, per run)")
    args = parser.parse_args()

    device = resolve_device(args.device)  # refuses cuda where there is none
    model_dir = args.model or bench_model_dir()
    model_name = BENCH_SPEC.name if args.model is None else model_dir.name
    if args.context_steps:
        run_context_steps(args, model_name, model_dir)
        return
    prompts = make_prompts(args.requests, AutoConfig.from_pretrained(model_dir).vocab_size)
    baselines = None
    if not (args.guided or args.step_overhead or args.parity):  # before the engine's two copies are loaded, and freed after
        baselines = run_baselines(model_dir, args.dtype, device, prompts[: args.baseline_requests], args.new_tokens)

    runner = ModelRunner(model_dir, args.dtype, args.device)
    decode_runner = ModelRunner(model_dir, args.dtype, args.device, enforce_eager=args.enforce_eager)
    for r in (runner, decode_runner):
        check_on_device(r.model, device)
    if args.parity:
        run_parity(args, model_dir, device, runner, decode_runner, prompts)
        return
    if args.guided:
        run_guided(args, model_name, runner, decode_runner, prompts, args.concurrency or [16, 64])
        return
    if args.step_overhead:
        run_step_overhead(args, model_name, runner, decode_runner, prompts, args.concurrency or [16, 64])
        return

    seq_tps, static_tps = baselines
    base = min(args.baseline_requests, len(prompts))
    rows = [("sequential `model.generate` (baseline)", 1, seq_tps, None),
            (f"one static `model.generate` batch of {base} (ceiling)", base, static_tps, None)]
    overhead = []
    asyncio.run(run_engine(runner, decode_runner, prompts[:4], 4, 4))  # warm up
    for c in args.concurrency or [1, 4, 16, 64]:
        times = StepTimes()
        run = asyncio.run(run_engine(runner, decode_runner, prompts, args.new_tokens, c, times=times))
        rows.append(("pdserve worker engine", c, run.tokens_per_s, run.ttft_p50_ms))
        if (summary := times.summary(c)) is not None:
            overhead.append((c, summary))
        print(f"engine concurrency {c}: {run.tokens_per_s:.0f} tok/s, TTFT p50 {run.ttft_p50_ms:.1f} ms",
              file=sys.stderr)

    print(f"\n{describe(args, model_name, runner)}; TTFT: from a request's submission to its first token.\n")
    print("| path | concurrency | tokens/s | vs sequential | vs static batch | TTFT p50 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, c, tps, ttft in rows:
        print(f"| {name} | {c} | {tps:.0f} | {tps / seq_tps:.2f}x | {tps / static_tps:.2f}x "
              f"| {'–' if ttft is None else f'{ttft:.1f}'} |")
    print_step_overhead(overhead)


if __name__ == "__main__":
    main()
