"""Images through encode workers: 1 encoder + 1 prefill + 1 decode worker ("E+P+D", `pdserve up --encoders 1`)
against 1 prefill + 1 decode worker ("P+D", the prefill worker decoding and encoding images itself), measured side
by side in one run.

    .venv/bin/python bench/vision.py                     # the embedded VLM, 192 requests per level at 16 and 64 clients
    .venv/bin/python bench/vision.py --model DIR --requests 32 --concurrency 8 32
    .venv/bin/python bench/vision.py --requests 6 --concurrency 2 --image-size 256x192     # a smoke run

Each setup is a fresh `pdserve up --model DIR` (default: the embedded tiny VLM), warmed up with `--warmup`
requests (images of their own, not measured). Two workloads, each at every `--concurrency` (clients, each sending
its next request when the last one ends), `--requests` requests per level:

- `repeated K`: many clients sending a small set of K images over and over (request N sends image N mod K), for
  each K of `--images` (8 and 48). The prefill worker keeps its default encoder cache of 32 images: 8 fit in it
  (P+D encodes each once too), 48 do not (P+D encodes again what its cache dropped; an encode worker keeps 256).
- `distinct`: every request a new image (distinct content), so nothing is cached anywhere.

Every request is a streamed /v1/chat/completions: distinct leading text ("Question N: ..."; the prefix cache
cannot hold the image's blocks, the text before them differs), then the image as a base64 PNG data URL, then a
question; `--max-tokens` (4) new tokens, temperature 0, ignore_eos. Images are `--image-size` (1024x768) PNGs of
a cheap deterministic pattern per image index, made once per run (the same images for both setups) and before
a level's clock starts.

Per (workload, concurrency, setup): requests ok / failed; TTFT p50 / p90 at the client; the prefill worker's busy
time per request: the CPU seconds (user + system, all threads) of the prefill worker's process during the level
over the requests sent; who encoded what: the coordinator's `pdserve_encoder_images_total` (images an encode
worker encoded / had cached / fallback or pull_failed: the prefill worker was sent the file) and the prefill
worker's own encoder cache misses (`pdserve_worker_encoder_cache_misses_total`). The prefill worker's process is
the one listening on its gRPC address in the coordinator's `GET /v1/instances` (the registration token from
`pdserve up`'s run folder). Ratios are E+P+D / P+D at the same workload and concurrency.

Targets: `repeated` (every K): prefill busy time per request at most 0.6x, TTFT p50 at most 0.8x; `distinct`:
TTFT p50 at most 1.1x (no worse). The exit status is 1 when a request failed, whatever the targets.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import re
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.serving import (OutcomeFigures, PdserveTarget, StartFailed, fmt, http_get, metric_sum, ratio,  # noqa: E402
                           stream_request)

SETUPS = {"E+P+D": ["--encoders", "1"], "P+D": []}
BASELINE = "P+D"
TARGETS = {"repeated": {"cpu": 0.6, "ttft": 0.8}, "distinct": {"ttft": 1.1}}
DISTINCT_BASE = 10_000  # image indices: repeated 0..images-1, distinct from here, warm-up from WARMUP_BASE
WARMUP_BASE = 1_000_000
OUTCOMES = ("encoded", "cached", "fallback", "pull_failed")


def log(msg: str) -> None:
    print(f"[vision {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------- images


@lru_cache(maxsize=None)
def image_url(index: int, width: int, height: int) -> str:
    """A PNG data URL of a deterministic pattern, different content for every index (made once per run)."""
    import numpy as np
    from PIL import Image

    x = np.arange(width, dtype=np.uint32)[None, :]
    y = np.arange(height, dtype=np.uint32)[:, None]
    red = (x * 7 + y * (index % 5 + 1) + index * 37 + 11) % 256
    green = (y * 5 + x * (index % 3 + 2) + index * 101 + 3) % 256
    blue = ((x ^ y) + (x * y >> 6) + index * 53) % 256
    pixels = np.stack(np.broadcast_arrays(red, green, blue), axis=-1).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, "PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def request_body(model_id: str, n: int, image: str, max_tokens: int) -> dict:
    content = [{"type": "text", "text": f"Question {n}: about request number {n * 7919 % 1000}, "},
               {"type": "image_url", "image_url": {"url": image}},
               {"type": "text", "text": " What does this picture show?"}]
    return {"model": model_id, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


# --------------------------------------------------------------------------------------- the cluster's parts


@dataclass
class Reading:
    """Counters at one moment: the prefill process's CPU seconds, the coordinator's images by encoder outcome,
    the prefill worker's encoder cache misses."""

    cpu_s: float | None
    images: dict[str, float] = field(default_factory=dict)
    misses: float | None = None


class Cluster:
    """A started `pdserve up`'s processes and metrics: the prefill worker's process (by its gRPC port), the
    coordinator's management URL, the prefill worker's metrics URL."""

    def __init__(self, target: PdserveTarget):
        import psutil

        log_text = target.log_text()
        m = re.search(r"^pdserve coordinator management: (\S+)", log_text, re.M)
        if not m:
            raise RuntimeError(f"no `pdserve coordinator management: URL` in {target.log_path}")
        self.management = m.group(1).rstrip("/")
        tree = psutil.Process(target.proc.pid).children(recursive=True)
        self.token = self._registration_token(tree)
        instances = self._instances()
        prefill = instances.get("prefill") or []
        if len(prefill) != 1:
            raise RuntimeError(f"expected 1 prefill instance in GET /v1/instances, got {len(prefill)}")
        port = int(prefill[0]["address"].rsplit(":", 1)[1])
        self.encoders = len(instances.get("encode") or [])
        self.prefill, listening = None, set()
        for proc in tree:
            try:
                ports = {c.laddr.port for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN}
            except (psutil.Error, OSError):
                continue
            if port in ports:
                self.prefill, listening = proc, ports
                break
        if self.prefill is None:
            raise RuntimeError(f"no process of `pdserve up` listens on the prefill worker's port {port}")
        # A static instance lists no metrics_url: its URL is one `pdserve up` printed, on a port it listens on.
        printed = re.findall(r"^pdserve worker metrics: (\S+)", log_text, re.M)
        self.prefill_metrics = prefill[0].get("metrics_url") or next(
            (u for u in printed if urlsplit(u).port in listening), None)

    @staticmethod
    def _registration_token(tree) -> str | None:
        for proc in tree:
            try:
                argv = proc.cmdline()
            except Exception:  # psutil.Error: gone, or not ours to read
                continue
            if "--security-config" in argv:
                config = json.loads(Path(argv[argv.index("--security-config") + 1]).read_text())
                token_file = (config.get("auth_config") or {}).get("registration_token_file")
                return Path(token_file).read_text().strip() if token_file else None
        return None

    def _instances(self) -> dict:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        request = urllib.request.Request(self.management + "/v1/instances", headers=headers)
        with urllib.request.urlopen(request, timeout=5) as resp:
            return json.loads(resp.read())

    def read(self) -> Reading:
        try:
            times = self.prefill.cpu_times()
            cpu = times.user + times.system
        except Exception:  # psutil.Error: the prefill worker is gone (restarted: a new process)
            cpu = None
        reading = Reading(cpu)
        status, text = http_get(self.management + "/metrics", timeout=5)
        if status == 200:
            for outcome in OUTCOMES:
                reading.images[outcome] = sum(float(v) for v in re.findall(
                    rf'^pdserve_encoder_images_total\{{outcome="{outcome}"\}}\s+(\S+)', text, re.M))
        if self.prefill_metrics:
            status, text = http_get(self.prefill_metrics.rstrip("/") + "/metrics", timeout=5)
            if status == 200 and "pdserve_worker_encoder_cache_misses" in text:
                reading.misses = metric_sum(text, "pdserve_worker_encoder_cache_misses_total")
        return reading


# ------------------------------------------------------------------------------------------------- a level


@dataclass
class Level(OutcomeFigures):
    setup: str
    workload: str
    concurrency: int
    outcomes: list
    wall_s: float
    cpu_s: float | None  # the prefill process's CPU seconds during the level
    images: dict[str, float]  # the coordinator's pdserve_encoder_images_total, during the level
    misses: float | None  # the prefill worker's encoder cache misses, during the level

    @property
    def cpu_per_request(self) -> float | None:
        return self.cpu_s / len(self.outcomes) if self.cpu_s is not None and self.outcomes else None


async def send_all(url: str, bodies: list[dict], concurrency: int) -> list:
    queue = list(bodies)
    outcomes = []

    async def client(session):
        while queue:
            outcomes.append(await stream_request(session, url, queue.pop(0)))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return outcomes


def measure(setup: str, workload: str, concurrency: int, target: PdserveTarget, cluster: Cluster,
            bodies: list[dict]) -> Level:
    url = f"{target.base_url}/v1/chat/completions"
    before = cluster.read()
    started = time.monotonic()
    outcomes = asyncio.run(send_all(url, bodies, concurrency))
    wall = time.monotonic() - started
    after = cluster.read()
    cpu = after.cpu_s - before.cpu_s if after.cpu_s is not None and before.cpu_s is not None else None
    images = {k: after.images.get(k, 0.0) - before.images.get(k, 0.0) for k in OUTCOMES} if after.images else {}
    misses = after.misses - before.misses if after.misses is not None and before.misses is not None else None
    return Level(setup, workload, concurrency, outcomes, wall, cpu, images, misses)


def run_setup(setup: str, extra: list[str], args, config: Path, log_dir: Path) -> list[Level]:
    target = PdserveTarget(setup.replace("+", ""), REPO, args.model, log_dir, 300.0,
                           extra_args=["--config", str(config), *extra])
    size = (args.width, args.height)
    levels: list[Level] = []
    log(f"starting {setup} ...")
    try:
        target.start()
        cluster = Cluster(target)
        log(f"{setup} ready in {target.startup_s:.0f}s: prefill worker pid {cluster.prefill.pid}, "
            f"{cluster.encoders} encode worker(s), prefill metrics {cluster.prefill_metrics or '?'}")
        if args.warmup:
            warm = asyncio.run(send_all(f"{target.base_url}/v1/chat/completions",
                                        [request_body(target.model_id, WARMUP_BASE + i,
                                                      image_url(WARMUP_BASE + i, *size), args.max_tokens)
                                         for i in range(args.warmup)], min(args.warmup, 4)))
            errors = [o.error for o in warm if not o.ok]
            if errors:
                log(f"{setup} warm-up: {len(errors)} failed: {errors[:2]}")
        n = 0  # request numbers: distinct leading text within the cluster, the same sequence in every setup
        distinct = DISTINCT_BASE
        for workload in args.workloads:
            for concurrency in args.concurrency:
                if workload != "distinct":  # "repeated K"
                    count = int(workload.split()[1])
                    images = [(n + i) % count for i in range(args.requests)]
                else:
                    images = list(range(distinct, distinct + args.requests))
                    distinct += args.requests
                bodies = [request_body(target.model_id, n + i, image_url(index, *size), args.max_tokens)
                          for i, index in enumerate(images)]  # the images made before the clock starts
                n += args.requests
                level = measure(setup, workload, concurrency, target, cluster, bodies)
                levels.append(level)
                log(f"{setup} {workload} c={concurrency}: {len(level.ok)}/{len(level.outcomes)} ok in "
                    f"{level.wall_s:.1f}s, TTFT p50 {fmt(level.ttft(0.5), '.3f')}s, prefill CPU "
                    f"{fmt(level.cpu_per_request, '.3f')}s/request, images {level.images}, "
                    f"prefill encoder misses {fmt(level.misses, '.0f')}")
    except (StartFailed, RuntimeError, OSError) as exc:
        log(f"{setup}: {exc}")
        raise SystemExit(f"{setup} could not be measured; log {target.log_path}") from None
    finally:
        target.stop()
        noted = [line for line in target.log_text().splitlines()
                 if re.search(r"level=(warning|error|critical)|Traceback", line)
                 and "coordinator draining" not in line]  # stopping it
        if noted:
            log(f"{setup}: {len(noted)} warning/error lines in {target.log_path}, e.g.:\n    "
                + "\n    ".join(line[:300] for line in noted[:5]))
    return levels


# ------------------------------------------------------------------------------------------------- output


def cpu_ratio(level: Level, base: Level | None) -> float | None:
    if base is None or level.cpu_per_request is None or not base.cpu_per_request:
        return None
    return level.cpu_per_request / base.cpu_per_request


def ttft_ratio(level: Level, base: Level | None) -> float | None:
    p50, b50 = level.ttft(0.5), base.ttft(0.5) if base else None
    return p50 / b50 if p50 is not None and b50 else None


def table(levels: list[Level], workloads: list[str]) -> str:
    base = {(lv.workload, lv.concurrency): lv for lv in levels if lv.setup == BASELINE}
    rows = ["| workload | clients | setup | ok | failed | TTFT p50 s | TTFT p90 s | TTFT p50 vs P+D "
            "| prefill CPU s/request | vs P+D | encode worker: encoded / cached | fallback / pull failed "
            "| prefill encoder misses |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    order = {s: i for i, s in enumerate(SETUPS)}
    for lv in sorted(levels, key=lambda lv: (workloads.index(lv.workload), lv.concurrency, order[lv.setup])):
        b = base.get((lv.workload, lv.concurrency))
        im = lv.images
        encoded = f"{im['encoded']:.0f} / {im['cached']:.0f}" if im else "–"
        fallback = f"{im['fallback']:.0f} / {im['pull_failed']:.0f}" if im else "–"
        rows.append(f"| {lv.workload} | {lv.concurrency} | {lv.setup} | {len(lv.ok)} | {len(lv.errors)} "
                    f"| {fmt(lv.ttft(0.5), '.3f')} | {fmt(lv.ttft(0.9), '.3f')} "
                    f"| {ratio(lv.ttft(0.5), b.ttft(0.5) if b else None)} | {fmt(lv.cpu_per_request, '.3f')} "
                    f"| {ratio(lv.cpu_per_request, b.cpu_per_request if b else None)} | {encoded} | {fallback} "
                    f"| {fmt(lv.misses, '.0f')} |")
    return "\n".join(rows)


def verdicts(levels: list[Level]) -> list[str]:
    base = {(lv.workload, lv.concurrency): lv for lv in levels if lv.setup == BASELINE}
    lines = []
    for lv in levels:
        if lv.setup == BASELINE:
            continue
        b = base.get((lv.workload, lv.concurrency))
        checks = []
        for what, limit in TARGETS[lv.workload.split()[0]].items():
            value = cpu_ratio(lv, b) if what == "cpu" else ttft_ratio(lv, b)
            name = "prefill CPU/request" if what == "cpu" else "TTFT p50"
            verdict = "not measured" if value is None else ("met" if value <= limit else "NOT met")
            checks.append(f"{name} {fmt(value, '.2f')}x (target ≤ {limit}x): {verdict}")
        failed = len(lv.errors) + (len(b.errors) if b else 0)
        note = f" ({failed} failed requests)" if failed else ""
        lines.append(f"- {lv.workload}, {lv.concurrency} clients: " + "; ".join(checks) + note)
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a vision-language model folder (default: the embedded VLM)")
    p.add_argument("--requests", type=int, default=192, help="requests per level (workload, concurrency, setup)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64], help="clients per level")
    p.add_argument("--images", type=int, nargs="+", default=[8, 48],
                   help="distinct images of each `repeated` workload (one workload per value)")
    p.add_argument("--warmup", type=int, default=4, help="requests per setup before measuring (own images)")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--image-size", default="1024x768", help="WIDTHxHEIGHT of every PNG")
    args = p.parse_args(argv)
    if args.model is None:
        from embedded_model.vlm_builder import ensure_default_vlm

        args.model = str(ensure_default_vlm())
    args.width, args.height = (int(v) for v in args.image_size.lower().split("x"))
    args.workloads = [f"repeated {count}" for count in args.images] + ["distinct"]
    levels: list[Level] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-vision-") as tmp:
        folder = Path(tmp)
        config = folder / "ms_coordinator.json"
        # manage_port 0: with --config, `pdserve up` keeps the config's management port (default 1026, maybe taken)
        config.write_text(json.dumps({"model_config": {"maxIterTimes": args.max_tokens},
                                      "http_config": {"manage_port": 0}}))
        for setup, extra in SETUPS.items():
            levels += run_setup(setup, extra, args, config, folder)
    print(f"model: {args.model}; {args.image_size} PNGs as data URLs; {args.requests} requests per level; "
          f"`repeated K`: K images; {args.max_tokens} new tokens each; ratios E+P+D / P+D")
    print()
    print(table(levels, args.workloads))
    print()
    print("Targets:")
    print("\n".join(verdicts(levels)))
    for lv in levels:
        for error in lv.errors[:3]:
            print(f"error ({lv.setup}, {lv.workload}, c={lv.concurrency}): {error}")
    return 0 if all(len(lv.ok) == len(lv.outcomes) for lv in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
