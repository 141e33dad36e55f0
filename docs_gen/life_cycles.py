"""The life-cycle docstrings: the numbered walk-throughs that open the modules driving a request, a worker's
requests, a token channel and a coordinator's place in etcd, shown as written (they are laid out as text)."""

from __future__ import annotations

import ast
from pathlib import Path

from docs_gen.markdown import banner

REPO = Path(__file__).resolve().parent.parent

# (title, module file), in the order a newcomer would follow a request.
LIFE_CYCLES = (
    ("A request in the coordinator", "coordinator/requests/pipeline.py"),
    ("Where a request's time went", "coordinator/requests/trace.py"),
    ("A request on a prefill and a decode worker", "worker/engine/__init__.py"),
    ("A decode step, bucketed and replayed", "worker/torch_engine/decode_step.py"),
    ("A request's images, from the client to the prefill worker", "coordinator/requests/media.py"),
    ("An image on a vision-language worker", "worker/torch_engine/vision.py"),
    ("A request's images on encode workers", "coordinator/requests/encoding.py"),
    ("An Encode call on an encode worker", "worker/torch_engine/encode_engine.py"),
    ("An image's embeddings pulled by a prefill worker", "kv_transfer/embeddings.py"),
    ("A LoRA adapter served by the coordinator", "coordinator/requests/loras.py"),
    ("A LoRA adapter on a worker", "worker/engine/lora.py"),
    ("A token channel", "worker/service/token_channel.py"),
    ("A worker's KV events subscription", "worker/service/kv_event_log.py"),
    ("A coordinator's watch of one worker's KV events", "coordinator/workers/kv_event_watch.py"),
    ("A request on vLLM instances", "coordinator/workers/vllm/client.py"),
    ("A coordinator's subscription to one vLLM instance's KV events", "coordinator/workers/vllm/kv_events.py"),
    ("A coordinator's leadership on etcd", "coordinator/cluster/leadership.py"),
    ("A worker's registration on etcd", "coordinator/cluster/registry_sync.py"),
    ("A coordinator replica's count on etcd", "coordinator/cluster/replica_census.py"),
    ("A client request's hold on its tenant", "coordinator/tenancy/tenants.py"),
    ("An online planner decision", "planner/online.py"),
    ("A role switch in place", "worker/service/role_switch.py"),
    ("A decode rebalancing round", "coordinator/scheduling/decode_rebalance.py"),
    ("A tick of the local autoscaler", "launcher/autoscaler.py"),
)

INTRO = """# Life cycles

The modules that drive a request open with a numbered account of its life there. They are shown here as
written; the code is the place to change them.
"""


def module_docstring(path: str) -> str:
    tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
    docstring = ast.get_docstring(tree)
    if not docstring:
        raise ValueError(f"{path} has no module docstring to show")
    return docstring


def render() -> str:
    parts = [banner(", ".join(path for _, path in LIFE_CYCLES)), INTRO]
    for title, path in LIFE_CYCLES:
        parts.append(f"## {title}\n\n`{path}`:\n\n```text\n{module_docstring(path)}\n```\n")
    return "\n".join(parts)
