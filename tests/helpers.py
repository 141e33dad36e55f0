"""Helpers shared by tests: real pdserve processes on free 127.0.0.1 ports, configs, stream readers."""

from __future__ import annotations

import asyncio
import inspect
import io
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
from aiohttp import web
import torch
from prometheus_client.parser import text_string_to_metric_families

from kv_transfer.base import KvLanding, TransferredKv
from kv_transfer.wire import kv_tensor_shape
from launcher.vllm_fleet import free_port as launcher_free_port
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from tests.fork_server import ForkClient, forkable

REPO = Path(__file__).resolve().parents[1]
CLUSTER_MAX_ITER_TIMES = 12
CLUSTER_MAX_SEQ_LEN = 512
# The session cluster decode worker's KV receive timeout: short enough for the stall tests, long enough that a
# prefill worker starved of CPU on a loaded machine (3 xdist workers on 2 cores) is not taken for a stalled one.
CLUSTER_KV_TIMEOUT_S = 15.0  # 8 s was missed by a prefill worker guiding a JSON schema beside `stress --cpu 2`
# Prompts whose greedy completions every serving path must reproduce token for token.
GREEDY_PROMPTS = [
    "Hello there",
    "The coordinator sends the prompt",
    "Once upon a time there was a little server that served tokens.",
    "1 2 3 4 5",
]


def pdserve_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher.cli", *args]


class ServerProcess:
    """A pdserve process started for a test: waits for its ready line, cleans up after itself."""

    def __init__(self, argv: list[str], ready_prefix: str, timeout_s: float = 120.0, env: dict | None = None,
                 fork: bool = True, cwd: Path = REPO):
        """`fork`: a worker or coordinator is forked from the test process's fork server (tests/fork_server.py)
        unless False, which spawns `python -m launcher.cli` itself (for tests of that start-up); `cwd`: another
        source tree's process (never forked: the fork server's children run this tree's code)."""
        self.argv = argv
        environment = {**os.environ, **(env or {})}
        if fork and forkable(argv) and cwd == REPO:
            self.proc = ForkClient.start(argv, environment, REPO)
        else:
            self.proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True, env=environment)
        self.output: list[str] = []
        lines: queue.Queue = queue.Queue()

        def pump():
            for line in self.proc.stdout:
                self.output.append(line)
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise TimeoutError(f"{argv} not ready after {timeout_s}s:\n{''.join(self.output)}")
            if line is None:
                raise RuntimeError(f"{argv} exited with {self.proc.wait()}:\n{''.join(self.output)}")
            if line.startswith(ready_prefix):
                self.address = line.strip().rsplit(" ", 1)[-1].split("=", 1)[-1]
                return

    def stop(self, timeout_s: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_worker(role: str, model_dir: Path, *extra: str) -> ServerProcess:
    argv = pdserve_argv("worker", "--role", role, "--model", str(model_dir), "--port", "0", *extra)
    return ServerProcess(argv, "pdserve worker ready:")


def write_config(path: Path, prefill: list[str], decode: list[str], model_dir: Path, sections: dict | None = None,
                 **model_overrides) -> Path:
    """An ms_coordinator.json for a test cluster; `sections` adds or replaces top-level sections."""
    config = {
        "http_config": {"predict_ip": "127.0.0.1", "predict_port": 0, "manage_port": 0},
        "model_config": {"modelName": "pdserve-tiny", "modelWeightPath": str(model_dir),
                         "maxSeqLen": CLUSTER_MAX_SEQ_LEN, "maxInputTokenLen": CLUSTER_MAX_SEQ_LEN,
                         "maxIterTimes": CLUSTER_MAX_ITER_TIMES, **model_overrides},
        "instances": {"prefill": [{"address": a} for a in prefill], "decode": [{"address": a} for a in decode]},
        **(sections or {}),
    }
    path.write_text(json.dumps(config))
    return path


def start_coordinator(config_path: Path, env: dict | None = None) -> ServerProcess:
    return ServerProcess(pdserve_argv("coordinator", "--config", str(config_path)), "pdserve coordinator ready:",
                         env=env)


def management_url(coordinator: ServerProcess) -> str:
    """The management URL a coordinator printed before its ready line."""
    line = next(l for l in coordinator.output if l.startswith("pdserve coordinator management:"))
    return line.strip().rsplit(" ", 1)[-1]


def serving_decode(coordinator) -> str:
    """The decode instance that has the one running request."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        body = httpx.get(f"{management_url(coordinator)}/v1/instances", timeout=5).json()
        busy = [i["address"] for i in body["decode"] if i["outstanding_requests"]]
        if busy:
            return busy[0]
    raise AssertionError("no decode instance took the request")


def instance_states(coordinator: ServerProcess) -> dict[str, dict[str, str]]:
    """role -> address -> state, from the coordinator's management API."""
    body = httpx.get(f"{management_url(coordinator)}/v1/instances", timeout=10).json()
    return {role: {i["address"]: i["state"] for i in group} for role, group in body.items()}


@dataclass
class Cluster:
    """A running coordinator with one prefill and one decode worker."""

    url: str
    prefill: ServerProcess
    decode: ServerProcess
    coordinator: ServerProcess
    model_dir: Path

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)


class BackgroundStream:
    """A streaming POST read on a thread, so a test can act on servers while it runs."""

    def __init__(self, url: str, body: dict):
        self.raw = b""
        self.ended_at: float | None = None
        self.arrivals: list[float] = []  # when each part came
        self.first_chunk = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url, body))
        self._thread.start()

    def _read(self, url: str, body: dict) -> None:
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", url, json=body) as r:
                for part in r.iter_raw():
                    self.raw += part
                    self.arrivals.append(time.monotonic())
                    self.first_chunk.set()
        self.ended_at = time.monotonic()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def longest_gap(self, since: float) -> float:
        """The longest wait for a part after monotonic time `since` (up to the end of the stream)."""
        times = [since, *(t for t in self.arrivals if t > since)]
        if self.ended_at is not None:
            times.append(self.ended_at)
        return max(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else float("inf")


def sse_events(raw: bytes) -> list[str]:
    """Split an SSE body into the payloads of its `data:` events, checking the framing."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), "an SSE stream must end with a blank line"
    events = text[:-2].split("\n\n")
    payloads = []
    for event in events:
        assert event.startswith("data: "), f"not an SSE data event: {event!r}"
        assert "\n" not in event, f"an event spans lines: {event!r}"
        payloads.append(event[len("data: "):])
    return payloads


def scrape(url: str) -> dict[tuple, float]:
    """Every sample of a Prometheus endpoint, keyed by (name, sorted labels)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def metrics_url(process: ServerProcess) -> str:
    """The metrics URL a worker printed before its ready line."""
    line = next(l for l in process.output if l.startswith("pdserve worker metrics:"))
    return line.strip().rsplit(" ", 1)[-1]


def health(address: str, role: str) -> pb.HealthResponse:
    """A worker's gRPC Health answer."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.PrefillServiceStub(channel) if role == "prefill" else pb_grpc.DecodeServiceStub(channel)
        return stub.Health(pb.HealthRequest(), timeout=5)


def wait_for_idle(address: str, role: str, timeout_s: float = 10.0) -> pb.HealthResponse:
    """Poll Health until the worker holds no KV (its budget, and every block of its pool back: free or cached) and
    runs nothing; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        h = health(address, role)
        if h.kv_used_tokens == 0 and h.num_running == 0 and h.num_waiting == 0 and h.num_kv_leases == 0 \
                and h.kv_free_blocks == h.kv_blocks:
            return h
        if time.monotonic() > deadline:
            raise AssertionError(f"{role} worker {address} still holds KV: {h}")
        time.sleep(0.05)


def peft_greedy(model_dir: Path, adapter_dir: Path | None, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of PEFT's own model under the adapter in `adapter_dir` (None: the base model), as
    transformers runs it: the reference a LoRA-serving path must equal token for token."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def transformers_greedy(model_dir: Path, prompt: str, max_new_tokens: int):
    """(tokenizer, prompt ids, greedy tokens) of a checkpoint's own `generate`, loaded for it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer, ids, out[0, len(ids):].tolist()


def reference_tokens(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers' own generate: what every pdserve path must reproduce."""
    model, tokenizer = hf_model
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return out[0, len(prompt_ids):].tolist()


def make_kv(dtype: torch.dtype, layers: int = 3, seq: int = 37) -> TransferredKv:
    """A small seeded KV cache for transport tests."""
    g = torch.Generator().manual_seed(7)
    tensors = [(torch.randn(seq, 2, 16, generator=g).to(dtype), torch.randn(seq, 2, 16, generator=g).to(dtype))
               for _ in range(layers)]
    return TransferredKv(request_id="req-1", layers=tensors, first_token_id=42, prefill_time_ms=1.5)


def token_major(t: torch.Tensor) -> torch.Tensor:
    """A transformers cache tensor ([1, kv_heads, positions, head_dim]) in the wire's layout."""
    return t[0].transpose(0, 1).contiguous()


def hf_prefill(hf_model, request_id: str, ids: list[int]) -> TransferredKv:
    """What a prefill worker would send: the prompt's KV and its greedy first token, from HF itself."""
    model, _ = hf_model
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
    layers = [(token_major(layer.keys), token_major(layer.values)) for layer in out.past_key_values.layers]
    return TransferredKv(request_id, layers, int(out.logits[0, -1].argmax()), prefill_time_ms=1.0)


def scattered_landing(header: pb.KvHeader, block_positions: int = 5) -> tuple[KvLanding, list[list[int]]]:
    """A stand-in for a decode worker's pool blocks, for a stream that `header` starts: blocks of `block_positions`
    positions placed in reverse order in one buffer per tensor, a run each; and the list the blocks are given back
    to."""
    n = header.shape[0]
    row = header.tensor_bytes // n
    blocks = -(-n // block_positions)
    size = block_positions * row
    runs = []
    for _ in range(2 * header.num_layers):
        memory = memoryview(bytearray(blocks * size))
        starts = [(blocks - 1 - b) * size for b in range(blocks)]
        runs.append([memory[start : start + min(size, header.tensor_bytes - b * size)] for b, start in enumerate(starts)])
    given_back: list[list[int]] = []
    return KvLanding(list(range(1, blocks + 1)), n, runs, given_back.append), given_back


def landed_bytes(landing: KvLanding, index: int) -> bytes:
    """Tensor `index`'s bytes (2 * layer + is_value) as its landing holds them, in position order."""
    return b"".join(bytes(run) for run in landing.runs[index])


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bytes, for bit-exact comparisons across dtypes."""
    return t.contiguous().view(torch.uint8)


def fake_prompt_kv(request_id: str, hf_model, prompt_len: int) -> TransferredKv:
    """A random KV cache shaped as the model's for a prompt of `prompt_len` tokens."""
    config = hf_model[0].config
    head_dim = config.hidden_size // config.num_attention_heads
    shape = kv_tensor_shape(prompt_len, config.num_key_value_heads, head_dim)
    layers = [(torch.randn(shape), torch.randn(shape)) for _ in range(config.num_hidden_layers)]
    return TransferredKv(request_id=request_id, layers=layers, first_token_id=5, prefill_time_ms=1.0)


def write_api_keys(path: Path, keys: list[str]) -> Path:
    """An auth_config.api_keys_file accepting `keys`: their SHA-256 digests, one per line, as an operator writes it."""
    from security.api_keys import hash_key

    path.write_text("# pdserve API keys (SHA-256 digests)\n" + "".join(hash_key(k) + "\n" for k in keys))
    return path


class FakeClock:
    """A clock a test moves by hand (`clock.now += 1`), for code that takes `clock=`."""

    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition"):
    """Poll `predicate` until it returns something truthy (returned), or fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")


async def wait_until(predicate, timeout_s: float = 30.0, what: str = "condition", interval_s: float = 0.01):
    """`wait_for` on the running event loop: poll `predicate` (a plain function, or one returning an awaitable)
    until it gives something truthy (returned), yielding the loop between polls; fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(interval_s)


def start_sim_worker(role: str, *extra: str) -> ServerProcess:
    """A `--simulate` worker (no model, ready in a second or two) on a free port."""
    return ServerProcess(pdserve_argv("worker", "--role", role, "--port", "0", "--simulate", *extra),
                         "pdserve worker ready:", timeout_s=30)


async def token_channel_opens(client, address: str):
    """The WorkerClient's token channel to the worker at `address`, once open (a first call named its listener)."""
    for _ in range(100):
        channel = client.token_channels.open_channel(address)
        if channel is not None:
            return channel
        await asyncio.sleep(0.05)
    raise AssertionError(f"no token channel to {address} opened")


def open_decode_by_hand(channel, request_id: str, prompt_len: int = 9, max_tokens: int = 4):
    """A greedy Decode call on a decode worker, the test standing in for the coordinator (and the prefill)."""
    return pb_grpc.DecodeServiceStub(channel).Decode(pb.DecodeRequest(
        request_id=request_id, prompt_len=prompt_len, max_seq_len=512,
        sampling=pb.SamplingParams(temperature=0, top_p=1, max_tokens=max_tokens)), timeout=30)


def one_route_app(handler) -> web.Application:
    """An in-process coordinator app serving only `handler` at POST /x, with the real error middleware and metrics."""
    from coordinator.http.request_gate import error_middleware
    from coordinator.metrics import METRICS, CoordinatorMetrics
    from coordinator.http.route_table import ROUTE_TABLE, ErrorStyle, Route, RouteTable

    app = web.Application(middlewares=[error_middleware])
    app[ROUTE_TABLE] = RouteTable([Route("POST", "/x", handler, ErrorStyle.OPENAI, "x")])
    app[METRICS] = CoordinatorMetrics()
    app[ROUTE_TABLE].add_to(app)
    return app


def kv_blocks_batch(role: str, token_ids: list[int], block_size: int = 16, epoch: str = "epoch-1", seq: int = 0,
                    reset: bool = True, removed: bool = False, medium: int = 0) -> pb.KvEventBatch:
    """A worker's KV events batch for the full blocks of `token_ids`: by default a snapshot holding them; with
    `reset` False, changes numbered up to `seq` (stored, or `removed`); `medium` 1: in its KV tier."""
    from kv_events.block_hash import ROOT_HASH, chain_hashes, hash_to_bytes

    hashes = chain_hashes(token_ids, block_size)
    events = []
    for i, h in enumerate(hashes):
        if removed:
            events.append(pb.KvBlockEvent(hash=hash_to_bytes(h), removed=True, medium=medium))
        else:
            parent = hashes[i - 1] if i else ROOT_HASH
            events.append(pb.KvBlockEvent(hash=hash_to_bytes(h), parent_hash=hash_to_bytes(parent) if i else b"",
                                          num_tokens=block_size, medium=medium))
    return pb.KvEventBatch(epoch=epoch, seq=seq, reset=reset, snapshot=reset, role=role, block_size=block_size,
                           events=events)


def index_matches_workers(coordinator: ServerProcess, workers: list[ServerProcess]):
    """Every worker's kv_index entry on the coordinator equals the worker's own snapshot (None if not yet)."""
    listed = httpx.get(f"{management_url(coordinator)}/v1/instances", timeout=10).json()
    held = {i["address"]: i["kv_index"] for group in listed.values() for i in group}
    for worker in workers:
        view, entry = worker_cache_view(worker.address), held.get(worker.address)
        if entry is None or any(entry[k] != view[k] for k in ("blocks", "digest", "epoch")):
            return None
    return held


def worker_cache_view(address: str) -> dict:
    """What a worker's prefix cache holds, from its own KvEvents.Watch snapshot, as KvIndex.describe shows an
    instance: block count, XOR digest, epoch, block size."""
    from kv_events.block_hash import hash_from_bytes

    with grpc.insecure_channel(address) as channel:
        call = pb_grpc.KvEventsStub(channel).Watch(pb.WatchKvEventsRequest(), timeout=10)
        blocks, batch = set(), None
        for batch in call:
            if not batch.snapshot:
                break
            blocks.update(hash_from_bytes(e.hash) for e in batch.events)
            if len(batch.events) < 8192:  # the snapshot's last batch
                break
        call.cancel()
    digest = 0
    for h in blocks:
        digest ^= h
    return {"blocks": len(blocks), "digest": f"{digest:032x}", "epoch": batch.epoch, "block_size": batch.block_size}


def local_prefill_by_hand(address: str, request_id: str, prompt_token_ids: list[int], max_tokens: int = 8) -> str:
    """A greedy local-prefill Decode on a decode worker, run to its end by the test (its blocks enter the worker's
    prefix cache); returns the worker's token channel address from `accepted`."""
    with grpc.insecure_channel(address) as channel:
        events = list(pb_grpc.DecodeServiceStub(channel).Decode(pb.DecodeRequest(
            request_id=request_id, prompt_len=len(prompt_token_ids), prompt_token_ids=prompt_token_ids,
            local_prefill=True, max_seq_len=4096,
            sampling=pb.SamplingParams(temperature=0, top_p=1, max_tokens=max_tokens, ignore_eos=True)), timeout=30))
    return events[0].accepted.token_channel_address


free_port = launcher_free_port  # one rule for ports bound later, launcher's and tests' alike


def image_bytes(color: tuple[int, int, int], size: tuple[int, int] = (40, 30), fmt: str = "PNG") -> bytes:
    """A small solid-colour picture with a gradient (so resizing and cropping matter), encoded as `fmt`."""
    from PIL import Image

    image = Image.new("RGB", size, color)
    for x in range(size[0]):
        image.putpixel((x, x % size[1]), (x * 7 % 256, 255 - color[1], x * 3 % 256))
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


def vlm_reference(vlm, parts: list[dict] | str, images: list[bytes], max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) of the VLM as transformers runs it: the processor's chat template and
    expansion, then `generate`, going on past EOS as `ignore_eos` does. `parts`: one user message's content parts
    ({"type": "image"} in image order), or a raw prompt text (its images as the processor's placeholder)."""
    from PIL import Image

    processor, model = vlm
    prompt = parts if isinstance(parts, str) else processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True)
    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    inputs = processor(images=pictures or None, text=prompt, return_tensors="pt")
    with torch.inference_mode():  # no EOS id: it does not stop there
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[])
    n = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, n:].tolist()


def descendants(pid: int) -> set[int]:
    """Every process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def cmdline(pid: int) -> str:
    """The command line of `pid`, its arguments joined by spaces."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def coordinator_pid(up: ServerProcess) -> int:
    """The coordinator process of a `pdserve up`."""
    return next(p for p in descendants(up.proc.pid) if " coordinator --config " in cmdline(p))


def registration_headers(up: ServerProcess) -> dict:
    """The proof `pdserve up`'s management port asks for, read from its coordinator's config file."""
    args = cmdline(coordinator_pid(up)).split()
    config = json.loads(Path(args[args.index("--config") + 1]).read_text())
    token = Path(config["auth_config"]["registration_token_file"]).read_text().strip()
    return {"Authorization": f"Bearer {token}"}


def greedy_completion(url: str, prompt: str, max_tokens: int) -> dict:
    """The one choice of a greedy /v1/completions with its prompt's and its own token ids."""
    resp = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "pdserve-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]
