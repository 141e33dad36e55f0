"""Images through PD: TTFT of chats that repeat one image, with the prefill worker's encoder cache against
without it (`--encoder-cache-images 0`), measured in the same run.

    .venv/bin/python bench/vision.py                        # the embedded VLM, 48 requests per level (~3 min)
    .venv/bin/python bench/vision.py --model DIR --requests 24 --concurrency 1 4

Each setup is a fresh `pdserve up --model DIR` (1 prefill + 1 decode worker) whose media folder holds one
`--image-size` PNG (default 1024x768: decoding and resizing it is most of what the embedded VLM's tiny vision
tower costs). Every request is a streamed /v1/chat/completions with distinct leading text ("Question N: ...")
and then that image and a question: the prefix cache cannot hold the image's blocks (the text before them
differs), so without the encoder cache every request decodes, preprocesses and encodes it again; with it, only
the first. `--max-tokens` (4) new tokens, temperature 0, ignore_eos. Per (setup, concurrency): TTFT p50 / p90
at the client, the encoder cache hits the prefill worker counted, and TTFT ratios against the no-cache setup.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.serving import OutcomeFigures, PdserveTarget, fmt, http_get, ratio, stream_request  # noqa: E402

SETUPS = {"encoder cache": [], "no encoder cache": ["--worker-args=--encoder-cache-images 0"]}
BASELINE = "no encoder cache"


class Level(OutcomeFigures):
    def __init__(self, setup: str, concurrency: int, outcomes: list, encoder_hits: float | None):
        self.setup, self.concurrency, self.outcomes, self.encoder_hits = setup, concurrency, outcomes, encoder_hits


def write_image(folder: Path, width: int, height: int) -> Path:
    from PIL import Image

    image = Image.new("RGB", (width, height))
    image.putdata([((x * 7) % 256, (y * 5) % 256, (x + y) % 256) for y in range(height) for x in range(width)])
    path = folder / "photo.png"
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    path.write_bytes(buffer.getvalue())
    return path


def encoder_hits(target: PdserveTarget) -> float | None:
    total = None
    for url in target.metrics_urls():
        status, text = http_get(url.rstrip("/") + "/metrics")
        for line in text.splitlines() if status == 200 else ():
            if line.startswith("pdserve_worker_encoder_cache_hits_total "):
                total = (total or 0.0) + float(line.split()[1])
    return total


async def run_level(target: PdserveTarget, image: Path, concurrency: int, requests: int, args, offset: int) -> list:
    url = f"{target.base_url}/v1/chat/completions"
    queue = list(range(offset, offset + requests))
    outcomes = []

    async def client(session):
        while queue:
            n = queue.pop(0)
            content = [{"type": "text", "text": f"Question {n}: about request number {n * 7919 % 1000}, "},
                       {"type": "image_url", "image_url": {"url": str(image)}},
                       {"type": "text", "text": " What does this picture show?"}]
            body = {"model": target.model_id, "messages": [{"role": "user", "content": content}],
                    "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            outcomes.append(await stream_request(session, url, body))

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return outcomes


def table(levels: list[Level]) -> str:
    base = {lv.concurrency: lv for lv in levels if lv.setup == BASELINE}
    rows = ["| setup | concurrency | ok | TTFT p50 s | TTFT p90 s | p50 vs no cache | p90 vs no cache | encoder hits |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for lv in levels:
        b = base.get(lv.concurrency)
        rows.append(f"| {lv.setup} | {lv.concurrency} | {len(lv.ok)}/{len(lv.outcomes)} | {fmt(lv.ttft(0.5), '.3f')} "
                    f"| {fmt(lv.ttft(0.9), '.3f')} | {ratio(lv.ttft(0.5), b.ttft(0.5) if b else None)} "
                    f"| {ratio(lv.ttft(0.9), b.ttft(0.9) if b else None)} | {fmt(lv.encoder_hits, '.0f')} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a vision-language model folder (default: the embedded VLM)")
    p.add_argument("--requests", type=int, default=48, help="requests per concurrency level")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--image-size", default="1024x768", help="WIDTHxHEIGHT of the repeated PNG")
    args = p.parse_args(argv)
    if args.model is None:
        from embedded_model.vlm_builder import ensure_default_vlm

        args.model = str(ensure_default_vlm())
    width, height = (int(v) for v in args.image_size.split("x"))
    levels: list[Level] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-vision-") as tmp:
        folder = Path(tmp)
        image = write_image(folder, width, height)
        config = folder / "ms_coordinator.json"
        config.write_text(json.dumps({"model_config": {"multimodalInputsDir": str(folder),
                                                       "maxIterTimes": args.max_tokens}}))
        for setup, extra in SETUPS.items():
            target = PdserveTarget(setup.replace(" ", "-"), REPO, args.model, folder, 300.0,
                                   extra_args=["--config", str(config), *extra])
            print(f"[vision] starting {setup} ...", file=sys.stderr)
            target.start()
            try:
                offset = 0
                for concurrency in args.concurrency:
                    before = encoder_hits(target) or 0.0
                    started = time.monotonic()
                    outcomes = asyncio.run(run_level(target, image, concurrency, args.requests, args, offset))
                    offset += args.requests
                    hits = encoder_hits(target)
                    levels.append(Level(setup, concurrency, outcomes, None if hits is None else hits - before))
                    print(f"[vision] {setup} c={concurrency}: {time.monotonic() - started:.1f}s", file=sys.stderr)
            finally:
                target.stop()
    print(f"model: {args.model}; image {args.image_size} PNG; {args.requests} requests per level; "
          f"{args.max_tokens} new tokens each")
    print(table(levels))
    for lv in levels:
        for error in lv.errors[:3]:
            print(f"error ({lv.setup}, c={lv.concurrency}): {error}")
    return 0 if all(len(lv.ok) == len(lv.outcomes) for lv in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
