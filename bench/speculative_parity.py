"""Speculative decoding's exactness on the real checkpoint through PD: greedy tokens with drafts against the same
workers without drafts, at 1 and at 4 concurrent rows.

    .venv/bin/python bench/speculative_parity.py [--prompts 50] [--max-tokens 256] [--method ngram]

Two clusters, one after the other, through `pdserve up --model DIR` (1 prefill + 1 decode worker): without drafts
(the reference, at 4 rows), then `--speculative METHOD` (at 1 row, then at 4). The prompts: half are edit tasks
whose answers copy their context (drafts are accepted in long runs), half open text; every third carries a stop
string and no prompt ignores EOS, so EOS and stop strings fall inside accepted runs. Each request is a
non-streamed /v1/completions with `return_token_ids`, temperature 0. Prints, per run, how many answers are
token-identical to the reference, the finish reasons, output tokens/s and the decode worker's mean acceptance
length; exits 1 if any answer differs.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.serving import DEFAULT_MODEL, PdserveTarget, http_get, metric_sum  # noqa: E402

STOPS = ["    return value * 5", "\n\n\n", "def handler_9", "The end", "Finally"]


def edit_prompt(rng: random.Random, n_lines: int) -> str:
    names = rng.sample(["handler", "parse", "load", "store", "check", "render", "route", "merge"], 3)
    lines = []
    for i in range(n_lines // 3):
        name = rng.choice(names)
        lines += [f"def {name}_{i}(request):", f"    value = request.get('field_{i}', {rng.randint(0, 99)})",
                  f"    return value * {rng.randint(1, 9)}"]
    change = f"{lines[3].split('(')[0][4:]} returning value * {rng.randint(10, 20)}"
    return "Original file:\n" + "\n".join(lines) + f"\n\nThe same file with {change}:\n" + lines[0] + "\n"


OPEN = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how a bicycle stays upright, step by step.", "List ten ideas for a rainy afternoon with children.",
        "Describe the water cycle to a ten-year-old.", "What makes a good cup of tea? Give detailed advice.",
        "Write a letter to a friend about a trip to the mountains.", "Summarize the rules of chess for a beginner.",
        "Give a recipe for vegetable soup with exact quantities.", "Why do leaves change colour in autumn?",
        "Write a poem about the sea and the wind."]


def prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = edit_prompt(rng, rng.randint(30, 60)) if i % 2 == 0 else \
            f"{OPEN[(i // 2) % len(OPEN)]} (Variation {i}.)\n"
        body = {"prompt": text}
        if i % 3 == 0:
            body["stop"] = [STOPS[i % len(STOPS)]]
        out.append(body)
    return out


async def run(target: PdserveTarget, bodies: list[dict], concurrency: int, max_tokens: int) -> tuple[list, float]:
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        async def one(body):
            async with gate:
                async with session.post(f"{target.base_url}/v1/completions", json={
                        **body, "model": target.model_id, "max_tokens": max_tokens, "temperature": 0,
                        "return_token_ids": True}) as resp:
                    data = await resp.json()
                    if resp.status != 200:
                        return (None, f"HTTP {resp.status}: {data}")
                    choice = data["choices"][0]
                    return (choice["token_ids"], choice["finish_reason"])

        start = time.monotonic()
        results = await asyncio.gather(*(one(b) for b in bodies))
        return results, time.monotonic() - start


def spec_counts(target: PdserveTarget) -> tuple[float, float]:
    """(drafts, accepted tokens) over the cluster's workers, from the metrics URLs `pdserve up` printed."""
    texts = [http_get(f"{url}/metrics")[1] for url in target.metrics_urls()]
    return (sum(metric_sum(t, "pdserve_worker_spec_decode_num_drafts_total") for t in texts),
            sum(metric_sum(t, "pdserve_worker_spec_decode_num_accepted_tokens_total") for t in texts))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--prompts", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--method", default="ngram", choices=["ngram", "suffix"])
    p.add_argument("--start-timeout", type=float, default=600)
    args = p.parse_args(argv)
    bodies = prompts(args.prompts)
    log_dir = Path(tempfile.mkdtemp(prefix="spec-parity-"))
    rows = []
    reference = None
    for name, extra, levels in [("without drafts", [], [4]), (f"--speculative {args.method}",
                                                               ["--speculative", args.method], [1, 4])]:
        target = PdserveTarget(name.replace(" ", "-").strip("-"), REPO, args.model, log_dir, args.start_timeout,
                               extra_args=extra)
        target.start()
        try:
            for c in levels:
                drafts, accepted = spec_counts(target)
                results, wall = asyncio.run(run(target, bodies, c, args.max_tokens))
                drafts, accepted = (after - before for after, before in zip(spec_counts(target), (drafts, accepted)))
                mal = f"{1 + accepted / drafts:.2f}" if drafts else "-"
                tokens = sum(len(ids or []) for ids, _ in results)
                if reference is None:
                    reference = results
                same = sum(a == b for a, b in zip(results, reference))
                reasons = {}
                for _, reason in results:
                    reasons[reason] = reasons.get(reason, 0) + 1
                rows.append(f"| {name} | {c} | {same}/{len(bodies)} | {reasons} | {tokens / wall:.1f} | {mal} | {wall:.0f} |")
                print(rows[-1], flush=True)
        finally:
            target.stop()
    print(f"\n{args.prompts} prompts x up to {args.max_tokens} tokens, model {args.model}, logs in {log_dir}\n")
    print("| run | rows | identical to without drafts (tokens, finish reason) | finish reasons | output tok/s | mean acceptance length | wall s |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0 if all(f"{len(bodies)}/{len(bodies)}" in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
