"""Speculative decoding through PD, drafts on against drafts off in one run, on the real checkpoint, with
transformers' own prompt-lookup decoding beside them; markdown tables with ratios against the drafts-off cluster.

    .venv/bin/python bench/speculative.py                                   # off, ngram, suffix; 1 and 16 streams
    .venv/bin/python bench/speculative.py --methods suffix --streams 1 16 --prompts 16 --max-tokens 256
    .venv/bin/python bench/speculative.py --quick                           # smoke: 2 prompts, 32 tokens, ngram
    .venv/bin/python bench/speculative.py --skip-hf --json /tmp/spec.json

Clusters, one after the other (never two at once: they would share the cores), each `pdserve up --model DIR
--predict-port P` (1 prefill + 1 decode worker) run from this checkout with PYTHONPATH=<repo>, stopped before the
next starts (bench/serving.py's PdserveTarget):

- `drafts off`: no speculative flag: the baseline every ratio divides by.
- one per `--methods` entry (default `ngram,suffix`): drafts on (`--spec-worker-args` adds worker flags to these
  clusters only, e.g. `--num-speculative-tokens 8`). How they are turned on is decided from this
  checkout's own `--help` texts, in this order: `pdserve up --speculative METHOD` (turns on the decode workers'
  drafts and the coordinator's corpus); else the worker flag through `--worker-args='--speculative-method METHOD'`,
  with a `--config` file holding `speculative_config.enabled: true` when the coordinator's config knows that
  section; else the cluster runs without drafts and the header says so (so the harness runs on a checkout without
  speculative decoding: its acceptance figures are then n/a).

The load, the same text on every cluster (token counts are the model's tokenizer's):

- `edit`: per stream level (`--streams`, default 1 16; a level above `--prompts` is capped to it), `--prompts`
  (16) streamed /v1/completions, each a deterministic Python-like, YAML or INI source file of 100-300 lines
  (fewer when the prompt would pass `--prompt-budget` tokens: SmolLM2's 2,048 context holds ~1,500 prompt tokens
  beside 256 new ones) in a completion prompt `Original file:\\n<file>\\nThe same file with <a small
  change>:\\n<its first two lines>\\n`. The real checkpoint copies some lines, then repeats one: drafts from the
  context predict both. Each level has its own files (seeded by the level). Greedy (temperature 0),
  `--max-tokens` (256), no ignore_eos (greedy output is the same on every cluster, so are the lengths).
- `corpus pass` (`pass2@N`): the largest level's files sent again, same concurrency, as a second pass: on a
  drafts-on cluster, what the coordinator's corpus of earlier answers adds to the acceptance (pass 2 / pass 1),
  with the draft hints it sent (`pdserve_draft_hints_sent_total` on its management port, before and after);
  the drafts-off cluster runs it too, so pass 2's tokens/s (its prompts now in the prefix cache) has a baseline.
- `chat`: `--chat-prompts` (32) streamed /v1/chat/completions of varied open questions at `--chat-streams` (16),
  `--chat-temperature` (0), `--chat-max-tokens` (128): where drafts seldom hit, what they cost.
- `hf`: after the clusters are stopped, the first `--hf-prompts` (4) files of the 1-stream level through
  transformers in this process, one stream, greedy, the same max tokens, with `--hf-threads` torch threads
  (default cores // 2: what `pdserve up` gives each of its two workers; on a busy 2-core machine 2 threads made
  transformers several times slower than 1): plain `generate` and `generate(prompt_lookup_num_tokens=10)`; and
  pdserve's 1-stream figures on the same prompts (each request of the 1-stream level ran alone: its tokens / its
  latency, prefill included as in transformers' time) beside them. `--skip-hf` leaves it out.

Figures per phase: output tokens/s = completion tokens (from `usage`) of the successful requests / wall time of
the phase (prefill included); decode tokens/s per stream = mean over requests of (tokens - 1) / (latency - TTFT);
TTFT p50; the 1-minute load average when the phase started (the machine may be shared); greedy outputs identical
to the drafts-off cluster's (same prompt, text compared); and from the decode worker's Prometheus counters (the
`pdserve worker metrics: URL` lines `pdserve up` prints), read before and after the phase:
`*spec_decode_num_drafts_total`, `*spec_decode_num_draft_tokens_total`, `*spec_decode_num_accepted_tokens_total`
(vLLM's names under pdserve's `pdserve_worker_` prefix); mean acceptance length = 1 + accepted / drafts (vLLM's
definition: tokens a draft-verify step yields), acceptance rate = accepted / draft tokens; and the rows that did
not draft, by reason (`*spec_decode_skipped_rows_total`). Counters absent: n/a. Outputs that differ from drafts
off are listed with where they first differ.

Targets printed beside the figures (issue 52): edit tokens/s >= 2.0x drafts off at 1 stream and >= 1.3x at 16;
mean acceptance length >= 2.5 on edit; greedy outputs identical; corpus pass 2 / pass 1 mean acceptance length
>= 1.5x; suffix / ngram mean acceptance length >= 1.1x; chat tokens/s >= 0.97x drafts off.

The client is aiohttp in this process (bench/serving.py's stream_request), sharing the machine's cores with the
cluster. The model: SmolLM2-135M-Instruct as `make real-model` builds it (FACTS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.serving import (DEFAULT_MODEL, SHOW_ERRORS, Outcome, PdserveTarget, StartFailed,  # noqa: E402
                           error_kind, fmt, free_port, git_describe, http_get, ratio, stream_request)

OFF = "drafts off"
METHODS = ("ngram", "suffix")
PL_TOKENS = 10  # transformers' prompt_lookup_num_tokens
TARGET_TPS_1 = 2.0
TARGET_TPS_16 = 1.3
TARGET_MAL = 2.5
TARGET_CORPUS = 1.5
TARGET_SUFFIX_VS_NGRAM = 1.1
TARGET_CHAT = 0.97
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def log(msg: str) -> None:
    print(f"[speculative {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ the workload

NOUNS = """order invoice customer session packet sensor ticket report batch record account shipment device channel
profile schedule payment message job node region bucket cache queue token route metric alert event upload user
tenant budget quota snapshot backup replica shard lease worker task plan""".split()
VERBS = """load parse validate render send store fetch merge split update compute format check build resolve encode
decode filter count sort publish archive refresh expire retry collect rotate assign""".split()
ADJS = """active pending stale remote local primary secondary hidden public private cached default current
previous partial""".split()
WORDS = """alpha beta gamma delta north south east west amber coral cedar maple river harbor summit meadow falcon
otter lynx heron""".split()
IMPORTS = ["import os", "import re", "import json", "import time", "import logging", "import hashlib",
           "import itertools", "import random", "from dataclasses import dataclass, field",
           "from pathlib import Path", "from typing import Any, Iterable, Optional",
           "from collections import defaultdict, deque", "from datetime import datetime, timedelta"]
TYPES = [("int", lambda r: str(r.randint(0, 500))), ("float", lambda r: f"{r.randint(1, 90) / 4:g}"),
         ("str", lambda r: json.dumps(r.choice(WORDS))), ("bool", lambda r: r.choice(["True", "False"])),
         ("Optional[str]", lambda r: "None")]


def _ident(rng: random.Random, parts: int = 2) -> str:
    pools = [ADJS, NOUNS] if parts == 2 else [NOUNS]
    return "_".join(rng.choice(p) for p in pools)


def _camel(name: str) -> str:
    return "".join(w.capitalize() for w in name.split("_"))


def _python_block(rng: random.Random, state: dict) -> list[str]:
    """A function or a dataclass, with varied statements."""
    if rng.random() < 0.3:
        name = _camel(f"{rng.choice(ADJS)}_{rng.choice(NOUNS)}")
        while name in state["names"]:
            name += rng.choice("ABCDEFGH")
        state["names"].add(name)
        lines = ["@dataclass", f"class {name}:", f'    """A {rng.choice(ADJS)} {rng.choice(NOUNS)} and its '
                 f'{rng.choice(NOUNS)}s."""', ""]
        used = set()
        for _ in range(rng.randint(3, 7)):
            f = _ident(rng, rng.choice([1, 2]))
            if f in used:
                continue
            used.add(f)
            typ, default = rng.choice(TYPES)
            lines.append(f"    {f}: {typ} = {default(rng)}")
        verb, noun = rng.choice(VERBS), rng.choice(NOUNS)
        lines += ["", f"    def {verb}_{noun}(self, limit: int = {rng.randint(2, 64)}) -> bool:",
                  f"        if self.{sorted(used)[0]} is None:", "            return False",
                  f"        logger.debug(\"{verb} {noun} of %s\", self)",
                  f"        return len(str(self.{sorted(used)[-1]})) < limit", "", ""]
        return lines
    verb, noun = rng.choice(VERBS), rng.choice(NOUNS)
    name = f"{verb}_{noun}s" if rng.random() < 0.5 else f"{verb}_{rng.choice(ADJS)}_{noun}"
    while name in state["names"]:
        name += "_" + rng.choice(WORDS)
    state["names"].add(name)
    state["functions"].append(name)
    arg, other = rng.choice(NOUNS), rng.choice(NOUNS)
    lines = [f"def {name}({arg}s: Iterable[dict], {other}_limit: int = {rng.randint(1, 100)}) -> list:",
             f'    """{verb.capitalize()} each {arg} against the {rng.choice(ADJS)} {other}s."""',
             "    result = []"]
    body = [
        lambda: [f"    {rng.choice(ADJS)}_{other} = {rng.choice(state['constants'])}"],
        lambda: [f"    seen = {rng.choice(['set()', 'dict()', 'defaultdict(int)', '[]'])}"],
        lambda: [f"    for item in {arg}s:",
                 f"        key = item.get(\"{rng.choice(NOUNS)}_id\", {rng.randint(0, 9)})",
                 f"        if key in seen or len(result) >= {other}_limit:",
                 f"            {rng.choice(['continue', 'break'])}",
                 f"        result.append({rng.choice(['key', 'item', 'str(key)', 'item.copy()'])})"],
        lambda: [f"    if not {arg}s:",
                 f"        logger.{rng.choice(['info', 'warning', 'debug'])}(\"no {arg}s to {verb}\")",
                 "        return result"],
        lambda: [f"    total = sum(int(x.get(\"{rng.choice(NOUNS)}\", 0)) for x in {arg}s)",
                 f"    logger.debug(\"{verb}: %d {other}s, total %d\", len(result), total)"],
        lambda: [f"    deadline = time.monotonic() + {rng.randint(1, 120)}",
                 "    while time.monotonic() < deadline and result:",
                 f"        result.pop({rng.choice(['0', '-1'])})"],
        lambda: [f"    digest = hashlib.sha1(json.dumps(result).encode()).hexdigest()[:{rng.randint(6, 16)}]",
                 f"    result.append({{\"digest\": digest, \"kind\": \"{rng.choice(WORDS)}\"}})"],
    ]
    for _ in range(rng.randint(2, 4)):
        lines += rng.choice(body)()
    returned = rng.choice(['result', 'sorted(result, key=str)', 'result[:' + str(rng.randint(5, 50)) + ']'])
    lines += [f"    return {returned}",
              "", ""]
    return lines


def python_file(rng: random.Random) -> tuple[list[str], list[str], list[str]]:
    """(header lines, blocks, candidate changes)."""
    path = f"{rng.choice(['services', 'core', 'jobs', 'api', 'storage'])}/{rng.choice(NOUNS)}_{rng.choice(VERBS)}.py"
    header = [f"# {path}", f'"""{rng.choice(ADJS).capitalize()} {rng.choice(NOUNS)} handling: '
              f'{rng.choice(VERBS)}, {rng.choice(VERBS)} and {rng.choice(VERBS)}."""', ""]
    imports = {"import logging", *rng.sample(IMPORTS, rng.randint(3, 7))}
    header += sorted(imports, key=lambda s: (s.startswith("from"), s)) + [""]
    header.append(f"logger = logging.getLogger(\"{rng.choice(WORDS)}.{rng.choice(NOUNS)}\")")
    header.append("")
    constants = []
    for _ in range(rng.randint(3, 6)):
        const = (f"{rng.choice(['MAX', 'DEFAULT', 'MIN'])}_{rng.choice(NOUNS).upper()}_"
                 f"{rng.choice(['COUNT', 'LIMIT', 'SIZE', 'TIMEOUT'])}")
        if const not in constants:
            constants.append(const)
            header.append(f"{const} = {rng.randint(2, 900)}")
    header += ["", ""]
    state = {"names": set(), "functions": [], "constants": constants}
    blocks = ["\n".join(_python_block(rng, state)) for _ in range(60)]
    fn = rng.choice(state["functions"]) if state["functions"] else "main"
    changes = [f"`{constants[0]}` set to {rng.randint(1000, 5000)}",
               f"the function `{fn}` renamed to `{fn}_v2`",
               f"the logger renamed to `log`", f"type hints removed from `{fn}`"]
    return header, blocks, changes


def yaml_file(rng: random.Random) -> tuple[list[str], list[str], list[str]]:
    header = [f"# deploy/{rng.choice(WORDS)}-{rng.choice(NOUNS)}.yaml",
              f"version: \"{rng.randint(2, 3)}.{rng.randint(0, 9)}\"", "services:"]
    blocks, names = [], []
    for _ in range(40):
        name = f"{rng.choice(NOUNS)}-{rng.choice(VERBS)}er"
        if name in names:
            continue
        names.append(name)
        lines = [f"  {name}:", f"    image: registry.{rng.choice(WORDS)}.internal/{name}:{rng.randint(1, 9)}."
                 f"{rng.randint(0, 30)}.{rng.randint(0, 9)}",
                 f"    replicas: {rng.randint(1, 12)}", "    ports:",
                 f"      - \"{rng.randint(3000, 9999)}:{rng.choice([80, 8080, 8000, 5000, 9090])}\"",
                 "    environment:"]
        for _ in range(rng.randint(2, 5)):
            lines.append(f"      {rng.choice(NOUNS).upper()}_"
                         f"{rng.choice(['URL', 'HOST', 'TTL', 'MODE', 'LEVEL', 'PATH'])}"
                         f": \"{rng.choice([rng.choice(WORDS), str(rng.randint(1, 600)), rng.choice(ADJS)])}\"")
        if rng.random() < 0.6:
            lines += ["    healthcheck:",
                      f"      test: [\"CMD\", \"curl\", \"-f\", \"http://localhost/{rng.choice(NOUNS)}z\"]",
                      f"      interval: {rng.randint(5, 60)}s", f"      retries: {rng.randint(1, 6)}"]
        if rng.random() < 0.5:
            deps = rng.sample(names, min(len(names), rng.randint(1, 2)))
            lines += ["    depends_on:"] + [f"      - {n}" for n in deps]
        blocks.append("\n".join(lines))
    svc = names[0]
    changes = [f"the replicas of `{svc}` set to {rng.randint(13, 40)}", f"the image tag of `{svc}` bumped to latest",
               "every healthcheck interval set to 30s", f"the service `{svc}` renamed to `{svc}-v2`"]
    return header, blocks, changes


def ini_file(rng: random.Random) -> tuple[list[str], list[str], list[str]]:
    header = [f"; {rng.choice(WORDS)}.ini: settings of the {rng.choice(NOUNS)} {rng.choice(VERBS)}er",
              f"; generated {2020 + rng.randint(0, 6)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}", ""]
    blocks, sections = [], []
    for _ in range(40):
        section = f"{rng.choice(NOUNS)}.{rng.choice(WORDS)}"
        if section in sections:
            continue
        sections.append(section)
        lines = [f"[{section}]"]
        for _ in range(rng.randint(3, 8)):
            key = (f"{rng.choice(ADJS)}_{rng.choice(NOUNS)}_"
                   f"{rng.choice(['limit', 'path', 'mode', 'timeout', 'enabled', 'host'])}")
            value = rng.choice([str(rng.randint(0, 10000)), rng.choice(["true", "false"]), rng.choice(WORDS),
                                f"/var/lib/{rng.choice(NOUNS)}/{rng.choice(WORDS)}", f"{rng.randint(1, 90)}s"])
            lines.append(f"{key} = {value}")
        lines.append("")
        blocks.append("\n".join(lines))
    changes = [f"the section `[{sections[0]}]` renamed to `[{sections[0]}.v2]`", "every timeout doubled",
               "every `true` changed to `yes`", f"a comment added above `[{sections[-1]}]`"]
    return header, blocks, changes


@dataclass
class EditTask:
    prompt: str
    kind: str
    lines: int
    prompt_tokens: int


def edit_task(rng: random.Random, count_tokens, budget: int) -> EditTask:
    """A 100-300 line file (fewer when `budget` prompt tokens would not hold 100) in an edit completion prompt."""
    kind = rng.choice(["python", "python", "yaml", "ini"])
    header, blocks, changes = {"python": python_file, "yaml": yaml_file, "ini": ini_file}[kind](rng)
    change = rng.choice(changes)
    want_lines = rng.randint(100, 300)

    def prompt(lines: list[str]) -> str:
        return f"Original file:\n" + "\n".join(lines) + f"\nThe same file with {change}:\n{lines[0]}\n{lines[1]}\n"

    lines = list(header)
    for block in blocks:
        candidate = lines + block.split("\n")
        if count_tokens(prompt(candidate)) > budget:
            break
        lines = candidate
        if len(lines) >= want_lines:
            break
    while lines and not lines[-1].strip():
        lines.pop()
    text = prompt(lines)
    return EditTask(text, kind, len(lines), count_tokens(text))


CHAT_TOPICS = """volcanoes, the printing press, photosynthesis, jazz, the Roman roads, black holes, bread baking,
chess openings, coral reefs, the Silk Road, electric cars, honeybees, lighthouses, origami, the moon landing, tea
ceremonies, glaciers, public libraries, sourdough, the immune system, wind turbines, medieval castles, octopuses,
compost, solar eclipses, trains in Japan, board games, rainforests, the first computers, migratory birds""".replace(
    "\n", " ").split(", ")
CHAT_TEMPLATES = ["What would you tell a curious ten-year-old about {t}?", "Give me three surprising facts about {t}.",
                  "Why do people find {t} interesting?", "Write a short poem about {t}.",
                  "How has {t} changed over the last hundred years?", "Explain {t} in a few sentences.",
                  "What are common misconceptions about {t}?", "Compare {t} and {u} in a short paragraph.",
                  "Write a two-sentence story that involves {t}.", "If you could ask an expert on {t} one question, "
                  "what would it be and why?"]


def chat_questions(n: int, seed: int = 52) -> list[str]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        t, u = rng.sample(CHAT_TOPICS, 2)
        q = rng.choice(CHAT_TEMPLATES).format(t=t.strip(), u=u.strip())
        if q not in out or len(out) >= len(CHAT_TOPICS) * len(CHAT_TEMPLATES):
            out.append(q)
    return out


# ------------------------------------------------------------------------------------------------ the clusters


@dataclass
class Capabilities:
    up_speculative: bool  # `pdserve up --speculative METHOD`
    worker_speculative: bool  # `pdserve worker --speculative-method METHOD`
    config_speculative: bool  # the coordinator config has speculative_config
    up_methods: list[str] = field(default_factory=list)

    def cluster_args(self, method: str | None, log_dir: Path, worker_args: str = "") -> tuple[list[str], str]:
        """`pdserve up` arguments for drafts by `method` (None: drafts off), with more worker flags `worker_args`
        for the drafts-on workers, and how they were turned on."""
        if method is None:
            return [], "no speculative flag"
        if self.up_speculative:
            more = [f"--worker-args={worker_args}"] if worker_args else []
            return ["--speculative", method, *more], f"`pdserve up --speculative {method}`" + (
                f" `--worker-args='{worker_args}'`" if worker_args else "")
        if self.worker_speculative:
            flags = f"--speculative-method {method}" + (f" {worker_args}" if worker_args else "")
            args = [f"--worker-args={flags}"]
            how = f"worker flags `{flags}` through --worker-args"
            if self.config_speculative:
                config = log_dir / f"coordinator-{method}.json"
                config.write_text(json.dumps({"http_config": {"manage_port": 0},
                                              "speculative_config": {"enabled": True}}, indent=1))
                args += ["--config", str(config)]
                how += f"; coordinator corpus on by `--config {config}` (speculative_config.enabled)"
            else:
                how += "; the coordinator has no speculative_config here (no corpus)"
            return args, how
        return [], "NOT AVAILABLE in this checkout (neither `pdserve up --speculative` nor `pdserve worker " \
                   "--speculative-method`): ran without drafts"


def detect_capabilities(repo: Path, env: dict) -> Capabilities:
    exe = str(repo / ".venv" / "bin" / "pdserve")

    def help_text(*cmd) -> str:
        return subprocess.run([exe, *cmd, "--help"], cwd=repo, env=env, capture_output=True, text=True).stdout

    up, worker = help_text("up"), help_text("worker")
    m = re.search(r"--speculative(?![-\w])\s*(?:\{([\w,-]+)\})?", up)
    check = subprocess.run([str(repo / ".venv" / "bin" / "python"), "-c",
                            "from coordinator.config import CoordinatorConfig as C; "
                            "print(any('speculative' in n for n in C.model_fields) or "
                            "any('speculative' in (f.alias or '') for f in C.model_fields.values()))"],
                           cwd=repo, env=env, capture_output=True, text=True).stdout.strip()
    return Capabilities(up_speculative=m is not None,
                        worker_speculative=re.search(r"--speculative-method(?![-\w])", worker) is not None,
                        config_speculative=check == "True",
                        up_methods=(m.group(1).split(",") if m and m.group(1) else []))


@dataclass
class SpecReading:
    """The spec-decode counters summed over the workers that answered, by URL; None per counter: not exposed."""

    values: dict[str, dict[str, float]] = field(default_factory=dict)  # url -> counter -> value
    names: set[str] = field(default_factory=set)  # the metric names found
    skipped: dict[str, dict[str, float]] = field(default_factory=dict)  # url -> reason -> rows that did not draft


def spec_counter(text: str, key: str) -> tuple[float, set[str]] | None:
    found = [(m.group(1), float(m.group(2))) for m in re.finditer(
        rf"^(\w*spec_decode_{key}_total)(?:\{{[^}}]*\}})?\s+(\S+)\s*$", text, re.M)]
    if not found:
        return None
    return sum(v for _, v in found), {n for n, _ in found}


def read_spec(urls: list[str]) -> SpecReading:
    reading = SpecReading()
    for url in urls:
        try:
            status, text = http_get(url.rstrip("/") + "/metrics")
        except OSError:
            continue
        if status != 200:
            continue
        values = {}
        for key in SPEC_COUNTERS:
            got = spec_counter(text, key)
            if got is not None:
                values[key] = got[0]
                reading.names |= got[1]
        reading.values[url] = values
        reading.skipped[url] = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^\w*spec_decode_skipped_rows_total\{[^}]*reason="([^"]+)"[^}]*\}\s+(\S+)\s*$', text, re.M)}
    return reading


@dataclass
class Spec:
    drafts: float | None = None
    draft_tokens: float | None = None
    accepted: float | None = None
    partial: bool = False
    skipped: dict[str, float] = field(default_factory=dict)  # reason -> decode rows that did not draft

    @property
    def mal(self) -> float | None:
        """Mean acceptance length: 1 + accepted / drafts (vLLM's)."""
        if self.drafts is None or self.accepted is None or self.drafts <= 0:
            return None
        return 1 + self.accepted / self.drafts

    @property
    def rate(self) -> float | None:
        if self.draft_tokens is None or self.accepted is None or self.draft_tokens <= 0:
            return None
        return self.accepted / self.draft_tokens

    def __add__(self, other: "Spec") -> "Spec":
        def add(a, b):
            return None if a is None and b is None else (a or 0) + (b or 0)
        skipped = dict(self.skipped)
        for reason, rows in other.skipped.items():
            skipped[reason] = skipped.get(reason, 0) + rows
        return Spec(add(self.drafts, other.drafts), add(self.draft_tokens, other.draft_tokens),
                    add(self.accepted, other.accepted), self.partial or other.partial, skipped)


def coordinator_hints(target: PdserveTarget) -> float | None:
    """`pdserve_draft_hints_sent_total` on the coordinator's management port (`pdserve up` prints its URL)."""
    m = re.search(r"^pdserve coordinator management: (\S+)", target.log_text(), re.M)
    if not m:
        return None
    try:
        status, text = http_get(m.group(1).rstrip("/") + "/metrics")
    except OSError:
        return None
    found = [float(v) for v in re.findall(r"^pdserve_draft_hints_sent_total(?:\{[^}]*\})?\s+(\S+)\s*$", text,
                                          re.M)]
    return sum(found) if status == 200 and found else None


def spec_delta(before: SpecReading, after: SpecReading) -> Spec:
    common = [u for u in after.values if u in before.values]
    out = Spec(partial=set(after.values) != set(before.values))
    for key, attr in zip(SPEC_COUNTERS, ("drafts", "draft_tokens", "accepted")):
        have = [u for u in common if key in after.values[u] and key in before.values[u]]
        if have:
            setattr(out, attr, sum(after.values[u][key] - before.values[u][key] for u in have))
    for u in common:
        for reason, rows in after.skipped.get(u, {}).items():
            delta = rows - before.skipped.get(u, {}).get(reason, 0)
            out.skipped[reason] = out.skipped.get(reason, 0) + delta
    return out


# ------------------------------------------------------------------------------------------------ the client


@dataclass
class Result:
    outcome: Outcome
    latency_s: float


@dataclass
class Phase:
    cluster: str
    name: str  # edit@1, edit@16, pass2@16, chat@16
    concurrency: int
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0
    spec: Spec = field(default_factory=Spec)
    skipped: str = ""
    load_1m: float | None = None  # the machine's 1-minute load average when the phase started
    hints: float | None = None  # draft hints the coordinator sent from its corpus during the phase (None: no metric)

    @property
    def ok(self) -> list[Outcome]:
        return [r.outcome for r in self.results if r.outcome.ok]

    @property
    def errors(self) -> list[str]:
        return [r.outcome.error for r in self.results if not r.outcome.ok]

    @property
    def tokens(self) -> int:
        return sum(o.completion_tokens for o in self.ok)

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.wall_s if self.wall_s > 0 and self.results else None

    @property
    def ttft_p50(self) -> float | None:
        values = [o.ttft_s for o in self.ok if o.ttft_s is not None]
        return statistics.median(values) if values else None

    @property
    def decode_tps(self) -> float | None:
        """Per stream, after the first token: mean over requests of (tokens - 1) / (latency - TTFT)."""
        values = [(r.outcome.completion_tokens - 1) / (r.latency_s - r.outcome.ttft_s) for r in self.results
                  if r.outcome.ok and r.outcome.ttft_s is not None and r.outcome.completion_tokens > 1
                  and r.latency_s > r.outcome.ttft_s]
        return statistics.fmean(values) if values else None

    def texts(self) -> list[str | None]:
        return [r.outcome.text if r.outcome.ok else None for r in self.results]

    def subset_tps(self, n: int) -> float | None:
        """The first n requests' tokens / their latencies (meaningful at concurrency 1: each ran alone)."""
        sel = [r for r in self.results[:n] if r.outcome.ok]
        time_s = sum(r.latency_s for r in sel)
        return sum(r.outcome.completion_tokens for r in sel) / time_s if time_s > 0 else None


async def run_requests(base_url: str, path: str, bodies: list[dict], concurrency: int,
                       timeout_s: float) -> tuple[list[Result], float]:
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        sem = asyncio.Semaphore(concurrency)

        async def one(body):
            async with sem:
                t0 = time.monotonic()
                outcome = await stream_request(session, base_url + path, body)
                return Result(outcome, time.monotonic() - t0)
        t0 = time.monotonic()
        results = await asyncio.gather(*(one(b) for b in bodies))
        return list(results), time.monotonic() - t0


def completion_body(model_id: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}


def chat_body(model_id: str, question: str, max_tokens: int, temperature: float) -> dict:
    return {"model": model_id, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}


def run_cluster(target: PdserveTarget, label: str, edit: dict[int, list[EditTask]],
                questions: list[str], args) -> tuple[list[Phase], str, set[str]]:
    """Start `target`, run every phase; (phases, what happened for the header, spec metric names seen)."""
    phases: list[Phase] = []
    names: set[str] = set()
    plan = [(f"edit@{c}", c, "/v1/completions", [completion_body("", t.prompt, args.max_tokens) for t in tasks])
            for c, tasks in edit.items()]
    if edit:  # pass 2 (the corpus pass); on the drafts-off cluster too, for its tok/s with the prompts cached
        c = max(edit)
        plan.append((f"pass2@{c}", c, "/v1/completions",
                     [completion_body("", t.prompt, args.max_tokens) for t in edit[c]]))
    if questions:
        c = min(args.chat_streams, len(questions))
        plan.append((f"chat@{c}", c, "/v1/chat/completions",
                     [chat_body("", q, args.chat_max_tokens, args.chat_temperature) for q in questions]))
    log(f"{label}: starting `{shlex.join(target.build_command()[1:])}` (logs {target.log_path})")
    try:
        target.start()
    except StartFailed as exc:
        log(f"{label}: {exc}")
        return [Phase(label, n, c, skipped=f"did not start: {str(exc).splitlines()[0]}") for n, c, _, _ in plan], \
            f"did not start: {str(exc).splitlines()[0]}", names
    status = f"ready in {target.startup_s:.0f} s: `{shlex.join(target.command)}`"
    log(f"{label}: ready in {target.startup_s:.0f} s at {target.base_url}, worker metrics {target.metrics_urls()}")
    warm = asyncio.run(run_requests(target.base_url, "/v1/completions",
                                    [completion_body(target.model_id, "Warm-up: the weather today is", 4)], 1,
                                    args.request_timeout))[0]
    warm += asyncio.run(run_requests(target.base_url, "/v1/chat/completions",
                                     [chat_body(target.model_id, "Hi", 4, 0)], 1, args.request_timeout))[0]
    if any(not r.outcome.ok for r in warm):
        log(f"{label}: warm-up errors: {[r.outcome.error for r in warm if not r.outcome.ok]}")
    for name, c, path, bodies in plan:
        if target.proc.poll() is not None:
            why = f"`pdserve up` exited with {target.proc.returncode} during the run"
            log(f"{label}: {why}; log {target.log_path}:\n{target.log_tail(40)}")
            status += f"; {why}"
            phases.append(Phase(label, name, c, skipped=why))
            continue
        if not target.wait_healthy(args.settle):
            log(f"{label}: /health not 200 after {args.settle:g} s; measuring anyway")
        for body in bodies:
            body["model"] = target.model_id
        urls = target.metrics_urls()
        before, hints_before = read_spec(urls), coordinator_hints(target)
        load = os.getloadavg()[0]
        results, wall = asyncio.run(run_requests(target.base_url, path, bodies, c, args.request_timeout))
        after, hints_after = read_spec(target.metrics_urls()), coordinator_hints(target)
        names |= after.names
        phase = Phase(label, name, c, results, wall, spec_delta(before, after), load_1m=load,
                      hints=None if hints_before is None or hints_after is None else hints_after - hints_before)
        phases.append(phase)
        log(f"{label} {name}: {len(phase.ok)}/{len(results)} ok, {phase.tokens} tokens, "
            f"{fmt(phase.tokens_per_s, '.1f')} tok/s, decode {fmt(phase.decode_tps, '.1f')} tok/s/stream, "
            f"mean acceptance length {fmt(phase.spec.mal, '.2f')}, hints {fmt(phase.hints, '.0f')}, "
            f"wall {wall:.1f} s")
        for error in phase.errors[:SHOW_ERRORS]:
            log(f"{label} {name} error: {error}")
    return phases, status, names


# ------------------------------------------------------------------------------------------------ transformers


@dataclass
class HfRun:
    name: str
    texts: list[str] = field(default_factory=list)
    tokens: int = 0
    time_s: float = 0.0

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.time_s if self.time_s > 0 else None


def run_hf(model_dir: str, prompts: list[str], max_tokens: int, threads: int | None) -> tuple[list[HfRun], str]:
    """Plain greedy generate and generate(prompt_lookup_num_tokens=10) per prompt, one stream, in this process."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    about = f"transformers {transformers.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    common = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None, "pad_token_id": tok.eos_token_id}
    runs = [HfRun("transformers generate"), HfRun(f"transformers prompt lookup ({PL_TOKENS})")]
    with torch.inference_mode():
        warm = tok("Warm-up: the weather today is", return_tensors="pt")
        model.generate(**warm, max_new_tokens=4, **common)
        model.generate(**warm, max_new_tokens=4, prompt_lookup_num_tokens=PL_TOKENS, **common)
        for i, prompt in enumerate(prompts):
            enc = tok(prompt, return_tensors="pt")
            for run, extra in zip(runs, ({}, {"prompt_lookup_num_tokens": PL_TOKENS})):
                t0 = time.perf_counter()
                out = model.generate(**enc, max_new_tokens=max_tokens, **common, **extra)
                elapsed = time.perf_counter() - t0
                new = out[0, enc["input_ids"].shape[1]:]
                run.tokens += int(new.shape[0])
                run.time_s += elapsed
                run.texts.append(tok.decode(new, skip_special_tokens=True))
                log(f"hf prompt {i}: {run.name}: {new.shape[0]} tokens in {elapsed:.1f} s")
    return runs, about


# ------------------------------------------------------------------------------------------------ output


def verdict(value: float | None, goal: float) -> str:
    return "n/a" if value is None else ("met" if value >= goal else "**not met**")


def ratio_value(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def fmt_ratio(r: float | None) -> str:
    return "–" if r is None else f"{r:.2f}x"


def edit_spec(phases: dict, label: str, levels: list[int]) -> Spec:
    """The edit levels' (pass 1) counters of one cluster, added up."""
    total = Spec()
    for c in levels:
        p = phases.get((label, f"edit@{c}"))
        if p and not p.skipped:
            total = total + p.spec
    return total


def first_difference(a: str | None, b: str | None) -> str:
    if a is None or b is None:
        return "a request failed"
    i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    return (f"first differs at character {i} of {len(b)}: drafts on {json.dumps(a[max(0, i - 20):i + 40])}, "
            f"drafts off {json.dumps(b[max(0, i - 20):i + 40])}")


def mismatch_notes(phases: dict, names: list[str]) -> list[str]:
    """The first differing output of each drafts-on phase against the drafts-off cluster's same prompts."""
    notes = []
    for (label, name), p in phases.items():
        base_name = name.replace("pass2@", "edit@")
        base = phases.get((OFF, base_name))
        if label == OFF or base is None or p.skipped or base.skipped:
            continue
        pairs = list(zip(p.texts(), base.texts()))
        bad = [i for i, (a, b) in enumerate(pairs) if a is None or a != b]
        if bad:
            notes.append(f"- {label} {name}: {len(bad)}/{len(pairs)} differ; prompt {bad[0]}: "
                         f"{first_difference(*pairs[bad[0]])}")
    return notes


def skipped_notes(phases: dict) -> list[str]:
    notes = []
    for (label, name), p in phases.items():
        rows = {k: v for k, v in p.spec.skipped.items() if v}
        if rows:
            notes.append(f"- {label} {name}: " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                             sorted(rows.items(), key=lambda kv: -kv[1])))
    return notes


def same_count(texts: list[str | None], reference: list[str | None]) -> tuple[int, int]:
    n = min(len(texts), len(reference))
    return sum(1 for a, b in zip(texts[:n], reference[:n]) if a is not None and a == b), n


PHASE_HEADER = ("| streams | cluster | ok/sent | output tok/s | vs drafts off | decode tok/s per stream | "
                "vs drafts off | TTFT p50 s | mean acceptance length | accepted / draft token | drafts | "
                "identical to drafts off | load 1m |", "|---:|---|" + "---:|" * 11)


def edit_table(phases: dict[tuple[str, str], Phase], clusters: list[str], levels: list[int]) -> list[str]:
    lines = list(PHASE_HEADER)
    for c in levels:
        base = phases.get((OFF, f"edit@{c}"))
        for cl in clusters:
            p = phases.get((cl, f"edit@{c}"))
            if p is None:
                continue
            lines.append(phase_row(c, cl, p, base))
    return lines


def phase_row(c: int, cl: str, p: Phase, base: Phase | None) -> str:
    if p.skipped:
        return f"| {c} | {cl} | – | {p.skipped[:80]} | – | – | – | – | – | – | – | – | – |"
    base_ok = base is not None and not base.skipped
    same = "–"
    if base_ok and cl != OFF:
        k, n = same_count(p.texts(), base.texts())
        same = f"{k}/{n}"
    return (f"| {c} | {cl} | {len(p.ok)}/{len(p.results)} | {fmt(p.tokens_per_s, '.1f')} | "
            f"{ratio(p.tokens_per_s, base.tokens_per_s) if base_ok else '–'} | {fmt(p.decode_tps, '.1f')} | "
            f"{ratio(p.decode_tps, base.decode_tps) if base_ok else '–'} | {fmt(p.ttft_p50, '.2f')} | "
            f"{fmt_na(p.spec.mal, '.2f', p.spec)} | {fmt_na(p.spec.rate, '.3f', p.spec)} | "
            f"{fmt_na(p.spec.drafts, '.0f', p.spec)} | {same} | {fmt(p.load_1m, '.1f')} |")


def fmt_na(value: float | None, spec: str, s: Spec) -> str:
    return "n/a" if value is None else format(value, spec) + (" (partial)" if s.partial else "")


def error_notes(phases: list[Phase]) -> list[str]:
    notes = []
    for p in phases:
        if p.errors:
            kinds = collections.Counter(error_kind(e) for e in p.errors)
            notes.append(f"- {p.cluster} {p.name}: {len(p.errors)} failed: " + "; ".join(
                f"{n} x `{kind[:300]}`" for kind, n in kinds.most_common(SHOW_ERRORS)))
    return notes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"HF model folder (default {DEFAULT_MODEL})")
    p.add_argument("--methods", default=None,
                   help="drafts-on clusters, comma-separated, each beside the drafts-off one (default ngram,suffix; "
                        "--quick: ngram)")
    p.add_argument("--streams", nargs="+", default=None,
                   help="edit-workload concurrency levels, e.g. 1 16 or 1,16 (default 1 16; capped to --prompts)")
    p.add_argument("--prompts", type=int, default=None, help="edit prompts per level (default 16; --quick: 2)")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per edit request (default 256; "
                                                                "--quick: 32)")
    p.add_argument("--prompt-budget", type=int, default=None,
                   help="most prompt tokens of an edit prompt (default min(1500, 2048 - max tokens - 32))")
    p.add_argument("--chat-prompts", type=int, default=None, help="chat requests (default 32; --quick: 2; 0 skips)")
    p.add_argument("--chat-streams", type=int, default=16, help="chat concurrency (default 16)")
    p.add_argument("--chat-max-tokens", type=int, default=None, help="new tokens per chat request (default 128; "
                                                                     "--quick: 16)")
    p.add_argument("--chat-temperature", type=float, default=0.0, help="chat temperature (default 0; e.g. 0.7)")
    p.add_argument("--hf-prompts", type=int, default=None,
                   help="edit prompts (of the 1-stream level) through transformers (default 4; --quick: 1)")
    p.add_argument("--hf-threads", type=int, default=None,
                   help="torch threads for transformers (default: what `pdserve up` gives each of its 2 workers, "
                        "cores // 2, so one stream gets the decode worker's threads)")
    p.add_argument("--skip-hf", action="store_true", help="no transformers phase")
    p.add_argument("--quick", action="store_true",
                   help="a short smoke: 2 prompts, 32 new tokens, 2 chat requests of 16 tokens, 1 HF prompt, "
                        "ngram only (explicit flags still win)")
    p.add_argument("--seed", type=int, default=52, help="workload seed (default 52)")
    p.add_argument("--pdserve-args", default="", help="extra arguments for every `pdserve up`")
    p.add_argument("--spec-worker-args", default="",
                   help="more worker flags for the drafts-on clusters, e.g. "
                        "--spec-worker-args='--num-speculative-tokens 8' (passed with --worker-args)")
    p.add_argument("--request-timeout", type=float, default=1800, help="seconds one request may take")
    p.add_argument("--start-timeout", type=float, default=600, help="seconds a cluster may take to become ready")
    p.add_argument("--settle", type=float, default=60, help="before each phase, wait up to this long for /health 200")
    p.add_argument("--log-dir", type=Path, default=None, help="where the clusters' logs go (default: a temp folder)")
    p.add_argument("--json", type=Path, default=None, help="also write every figure to this file")
    args = p.parse_args(argv)
    q = args.quick
    args.methods = [m.strip() for m in (args.methods or ("ngram" if q else ",".join(METHODS))).split(",")
                    if m.strip()]
    streams = [int(s) for item in (args.streams or ["1", "16"]) for s in str(item).split(",") if s.strip()]
    args.prompts = args.prompts if args.prompts is not None else (2 if q else 16)
    args.max_tokens = args.max_tokens if args.max_tokens is not None else (32 if q else 256)
    args.chat_prompts = args.chat_prompts if args.chat_prompts is not None else (2 if q else 32)
    args.chat_max_tokens = args.chat_max_tokens if args.chat_max_tokens is not None else (16 if q else 128)
    args.hf_threads = args.hf_threads or max(1, (os.cpu_count() or 1) // 2)
    args.hf_prompts = args.hf_prompts if args.hf_prompts is not None else (1 if q else 4)
    if args.prompts < 1 or args.max_tokens < 1 or not streams or min(streams) < 1 or args.chat_prompts < 0:
        p.error("--prompts, --max-tokens and --streams must be >= 1, --chat-prompts >= 0")
    args.streams = list(dict.fromkeys(min(s, args.prompts) for s in streams))
    if args.prompt_budget is None:
        args.prompt_budget = min(1500, 2048 - args.max_tokens - 32)
    if args.prompt_budget < 200:
        p.error(f"--prompt-budget {args.prompt_budget}: too small for a file (lower --max-tokens)")
    if not (Path(args.model) / "config.json").exists():
        p.error(f"--model {args.model}: no config.json there (`make real-model` builds the default)")
    return args


def main(argv=None) -> int:
    t_start = time.monotonic()
    args = parse_args(argv)
    python = os.path.relpath(sys.executable)
    command = shlex.join([python if not python.startswith("..") else sys.executable, sys.argv[0]]
                         + (sys.argv[1:] if argv is None else argv))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-speculative-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)

    def count_tokens(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    edit = {c: [edit_task(random.Random(args.seed * 1000 + c * 100 + i), count_tokens, args.prompt_budget)
                for i in range(args.prompts)] for c in args.streams}
    questions = chat_questions(args.chat_prompts, args.seed)
    all_tasks = [t for tasks in edit.values() for t in tasks]
    log(f"edit prompts: {len(all_tasks)}, {min(t.lines for t in all_tasks)}-{max(t.lines for t in all_tasks)} lines, "
        f"{min(t.prompt_tokens for t in all_tasks)}-{max(t.prompt_tokens for t in all_tasks)} prompt tokens; "
        f"logs in {log_dir}")

    probe = PdserveTarget("probe", REPO, args.model, log_dir, args.start_timeout, extra_args=[])
    caps = detect_capabilities(REPO, probe.env())
    log(f"speculative flags here: pdserve up --speculative: {caps.up_speculative} {caps.up_methods or ''}; "
        f"pdserve worker --speculative-method: {caps.worker_speculative}; coordinator speculative_config: "
        f"{caps.config_speculative}")

    clusters: list[tuple[str, str | None]] = [(OFF, None)] + [(m, m) for m in args.methods]
    phases: dict[tuple[str, str], Phase] = {}
    started: dict[str, str] = {}
    how: dict[str, str] = {}
    metric_names: set[str] = set()
    for label, method in clusters:
        extra, how[label] = caps.cluster_args(method, log_dir, args.spec_worker_args)
        target = PdserveTarget(label.replace(" ", "-"), REPO, args.model, log_dir, args.start_timeout,
                               extra_args=extra + shlex.split(args.pdserve_args))
        try:
            got, started[label], names = run_cluster(target, label, edit, questions, args)
        finally:
            target.stop()
        metric_names |= names
        for ph in got:
            phases[(label, ph.name)] = ph

    hf_runs: list[HfRun] = []
    hf_about = ""
    one_level = 1 if 1 in edit else None
    hf_prompts = [t.prompt for t in edit[one_level or args.streams[0]][:args.hf_prompts]]
    if not args.skip_hf and hf_prompts:
        log(f"transformers: {len(hf_prompts)} edit prompts, plain generate and prompt lookup ...")
        hf_runs, hf_about = run_hf(args.model, hf_prompts, args.max_tokens, args.hf_threads)

    # ------------------------------------------------------------------------------------------- the report
    names = [label for label, _ in clusters]
    methods = [label for label, m in clusters if m is not None]
    levels = args.streams
    total_wall = time.monotonic() - t_start
    out = [f"## bench/speculative.py, {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs",
           "", f"Command: `{command}`", "",
           f"Model: `{args.model}`; checkout `{REPO}` at {git_describe(REPO)}. One prefill + one decode worker per "
           f"cluster, one cluster at a time; ratios against `{OFF}`, measured in this run. Clusters:"]
    for label in names:
        out.append(f"- `{label}`: drafts by {how[label]}; {started.get(label, 'not run')}")
    out.append(f"- Spec-decode counters found: {', '.join(f'`{n}`' for n in sorted(metric_names)) or 'none (n/a)'}.")
    kinds = collections.Counter(t.kind for t in all_tasks)
    out += ["", f"### edit: {args.prompts} streamed /v1/completions per level, a {min(t.lines for t in all_tasks)}-"
            f"{max(t.lines for t in all_tasks)} line file ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}; "
            f"{min(t.prompt_tokens for t in all_tasks)}-{max(t.prompt_tokens for t in all_tasks)} prompt tokens, mean "
            f"{statistics.fmean(t.prompt_tokens for t in all_tasks):.0f}) + \"The same file with <change>:\" + its "
            f"first two lines; greedy, max_tokens {args.max_tokens}", ""]
    out += edit_table(phases, names, levels)

    # corpus
    if methods:
        c = max(levels)
        out += ["", f"### corpus pass: the {args.prompts} edit prompts of the {c}-stream level sent again (pass 2) to "
                f"the same drafts-on cluster, {c} at a time (pass 2's tok/s also has its prompts in the prefix "
                f"cache)", "",
                "| cluster | pass 1 tok/s | pass 2 tok/s | pass 2 tok/s vs drafts off's pass 2 | pass 1 mean acc. "
                "length | pass 2 mean acc. length | pass 2 / pass 1 | pass 1 accepted/draft token | pass 2 accepted/"
                "draft token | pass 2 / pass 1 | "
                f"target >= {TARGET_CORPUS}x | hints sent pass 1 / pass 2 | pass 2 identical to drafts off |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
        base = phases.get((OFF, f"edit@{c}"))
        base2 = phases.get((OFF, f"pass2@{c}"))
        for m in methods:
            p1, p2 = phases.get((m, f"edit@{c}")), phases.get((m, f"pass2@{c}"))
            if p1 is None or p2 is None or p1.skipped or p2.skipped:
                out.append(f"| {m} | – | – | – | – | – | – | – | – | – | n/a | – | – |")
                continue
            mal_r = ratio_value(p2.spec.mal, p1.spec.mal)
            k, n = same_count(p2.texts(), base.texts()) if base and not base.skipped else (0, 0)
            out.append(f"| {m} | {fmt(p1.tokens_per_s, '.1f')} | {fmt(p2.tokens_per_s, '.1f')} | "
                       f"{ratio(p2.tokens_per_s, base2.tokens_per_s) if base2 and not base2.skipped else '–'} | "
                       f"{fmt_na(p1.spec.mal, '.2f', p1.spec)} | {fmt_na(p2.spec.mal, '.2f', p2.spec)} | "
                       f"{fmt_ratio(mal_r)} | {fmt_na(p1.spec.rate, '.3f', p1.spec)} | "
                       f"{fmt_na(p2.spec.rate, '.3f', p2.spec)} | {ratio(p2.spec.rate, p1.spec.rate)} | "
                       f"{verdict(mal_r, TARGET_CORPUS)} | {fmt(p1.hints, '.0f')} / {fmt(p2.hints, '.0f')} | "
                       f"{f'{k}/{n}' if n else '–'} |")

    # chat
    chat_phases = {label: ph for (label, name), ph in phases.items() if name.startswith("chat@")}
    if chat_phases:
        c = next(iter(chat_phases.values())).concurrency
        out += ["", f"### chat: {args.chat_prompts} streamed /v1/chat/completions of open questions, {c} at a time, "
                f"temperature {args.chat_temperature:g}, max_tokens {args.chat_max_tokens}", "",
                *PHASE_HEADER]
        for label in names:
            ph = chat_phases.get(label)
            if ph is not None:
                out.append(phase_row(c, label, ph, chat_phases.get(OFF)))
        if args.chat_temperature > 0:
            out.append("")
            out.append(f"(temperature {args.chat_temperature:g}: outputs and their lengths differ between clusters "
                       "by sampling; tokens/s still compares.)")

    # transformers
    if hf_runs:
        n = len(hf_prompts)
        one = {label: phases.get((label, f"edit@{one_level}")) for label in names} if one_level else {}
        plain, pl = hf_runs
        off_texts = (one.get(OFF).texts()[:n] if one.get(OFF) and not one.get(OFF).skipped else [])
        out += ["", f"### transformers prompt lookup: the first {n} edit prompt(s) of the "
                f"{one_level or args.streams[0]}-stream level, one stream, greedy, max_new_tokens {args.max_tokens} "
                f"({hf_about}, in this process, no cluster running); pdserve rows: the same prompts' requests of the "
                f"1-stream level (tokens / their latencies)", "",
                "| engine | output tok/s | vs transformers generate | vs pdserve drafts off | identical to pdserve "
                "drafts off |", "|---|---:|---:|---:|---:|"]
        off_tps = one[OFF].subset_tps(n) if one.get(OFF) and not one[OFF].skipped else None
        for run in hf_runs:
            k, m = same_count(run.texts, off_texts) if off_texts else (0, 0)
            out.append(f"| {run.name} | {fmt(run.tokens_per_s, '.1f')} | {ratio(run.tokens_per_s, plain.tokens_per_s)} "
                       f"| {ratio(run.tokens_per_s, off_tps)} | {f'{k}/{m}' if m else '–'} |")
        for label in names:
            ph = one.get(label)
            if ph is None or ph.skipped:
                continue
            tps = ph.subset_tps(n)
            out.append(f"| pdserve {label} | {fmt(tps, '.1f')} | {ratio(tps, plain.tokens_per_s)} | "
                       f"{ratio(tps, off_tps)} | "
                       f"{'–' if label == OFF else '%d/%d' % same_count(ph.texts()[:n], off_texts)} |")
        k, m = same_count(pl.texts, plain.texts)
        out.append("")
        out.append(f"transformers prompt lookup's greedy text equals plain generate's on {k}/{m} prompts.")

    # targets
    out += ["", "### targets (issue 52)", "", "| check | cluster | figure | target | verdict |",
            "|---|---|---:|---|---|"]
    lo, hi = min(levels), max(levels)
    for m in methods:
        for c in dict.fromkeys((lo, hi)):
            goal = TARGET_TPS_1 if c == 1 else (TARGET_TPS_16 if c >= 16 else None)
            p, b = phases.get((m, f"edit@{c}")), phases.get((OFF, f"edit@{c}"))
            r = ratio_value(p.tokens_per_s, b.tokens_per_s) if p and b and not p.skipped and not b.skipped else None
            goal_txt, v = ("(no target at this level)", "–") if goal is None else (f">= {goal}x", verdict(r, goal))
            out.append(f"| edit tok/s vs drafts off, {c} stream(s) | {m} | {fmt_ratio(r)} | {goal_txt} | {v} |")
        spec = edit_spec(phases, m, levels)
        out.append(f"| edit mean acceptance length (all levels, pass 1) | {m} | {fmt_na(spec.mal, '.2f', spec)} | "
                   f">= {TARGET_MAL} | {verdict(spec.mal, TARGET_MAL)} |")
        same = [same_count(phases[(m, f'edit@{c}')].texts(), phases[(OFF, f'edit@{c}')].texts())
                for c in levels if (m, f"edit@{c}") in phases and (OFF, f"edit@{c}") in phases]
        k, n = sum(s[0] for s in same), sum(s[1] for s in same)
        out.append(f"| greedy edit outputs identical to drafts off | {m} | {k}/{n} | all | "
                   f"{'met' if n and k == n else ('n/a' if not n else '**not met**')} |")
        p1, p2 = phases.get((m, f"edit@{hi}")), phases.get((m, f"pass2@{hi}"))
        r = ratio_value(p2.spec.mal, p1.spec.mal) if p1 and p2 else None
        out.append(f"| corpus: pass 2 / pass 1 mean acceptance length | {m} | {fmt_ratio(r)} | >= {TARGET_CORPUS}x "
                   f"| {verdict(r, TARGET_CORPUS)} |")
        ch, cb = chat_phases.get(m), chat_phases.get(OFF)
        r = ratio_value(ch.tokens_per_s, cb.tokens_per_s) if ch and cb and not ch.skipped and not cb.skipped else None
        if ch is not None:
            out.append(f"| chat tok/s vs drafts off, {ch.concurrency} streams | {m} | {fmt_ratio(r)} | "
                       f">= {TARGET_CHAT}x | {verdict(r, TARGET_CHAT)} |")
    if "ngram" in methods and "suffix" in methods:
        for what, key in (("edit pass 1, all levels", None), (f"corpus pass 2 ({hi} streams)", f"pass2@{hi}")):
            if key is None:
                a, b = edit_spec(phases, "suffix", levels), edit_spec(phases, "ngram", levels)
            else:
                a = phases[("suffix", key)].spec if ("suffix", key) in phases else Spec()
                b = phases[("ngram", key)].spec if ("ngram", key) in phases else Spec()
            r = ratio_value(a.mal, b.mal)
            out.append(f"| suffix / ngram mean acceptance length, {what} | suffix | {fmt_ratio(r)} "
                       f"(accepted/draft token {ratio(a.rate, b.rate)}) | >= {TARGET_SUFFIX_VS_NGRAM}x | "
                       f"{verdict(r, TARGET_SUFFIX_VS_NGRAM)} |")
    if hf_runs and one_level:
        n = len(hf_prompts)
        for m in methods:
            ph = phases.get((m, f"edit@{one_level}"))
            tps = ph.subset_tps(n) if ph and not ph.skipped else None
            out.append(f"| pdserve 1 stream vs transformers prompt lookup ({n} prompts) | {m} | "
                       f"{ratio(tps, hf_runs[1].tokens_per_s)} | (none) | – |")

    notes = mismatch_notes(phases, names)
    if notes:
        out += ["", "Outputs that differ from drafts off (greedy: they should not):"] + notes
    notes = skipped_notes(phases)
    if notes:
        out += ["", "Decode rows that did not draft, by reason (`*spec_decode_skipped_rows_total`, during the "
                "phase):"] + notes
    notes = error_notes(list(phases.values()))
    if notes:
        out += ["", "Errors:"] + notes
    out += ["", f"Total wall time: {total_wall:.0f} s ({total_wall / 60:.1f} min)."]
    print("\n".join(out))

    if args.json:
        args.json.write_text(json.dumps({
            "command": command, "model": args.model, "clusters": {label: {"how": how[label],
                                                                          "started": started.get(label)}
                                                                  for label in names},
            "phases": [{"cluster": p.cluster, "phase": p.name, "concurrency": p.concurrency, "sent": len(p.results),
                        "ok": len(p.ok), "errors": p.errors, "wall_s": p.wall_s, "tokens": p.tokens,
                        "tokens_per_s": p.tokens_per_s, "ttft_p50_s": p.ttft_p50, "drafts": p.spec.drafts,
                        "draft_tokens": p.spec.draft_tokens, "accepted": p.spec.accepted,
                        "mean_acceptance_length": p.spec.mal, "hints_sent": p.hints, "skipped_rows": p.spec.skipped,
                        "skipped": p.skipped,
                        "latencies_s": [r.latency_s for r in p.results]} for p in phases.values()],
            "hf": [{"name": r.name, "tokens": r.tokens, "time_s": r.time_s, "tokens_per_s": r.tokens_per_s}
                   for r in hf_runs], "total_wall_s": total_wall}, indent=1))
    return 0 if all(not p.skipped for p in phases.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
