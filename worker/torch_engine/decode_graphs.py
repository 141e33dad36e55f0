"""CUDA graphs of the bucketed decode step (decode_step.py): one per (batch bucket, context bucket), replayed.

On a GPU a small model's decode step is bound by launching its kernels from Python (~40-50 per layer), not by
their work; a graph launches them all at once. Each graph is captured at start-up, the largest first, in one memory
pool (the smaller ones reuse the largest's memory), after the KV pool is made (a graph keeps the addresses it read
and wrote: the pool's tensors, the step's buffers and its own gather buffers). What the graphs take is reserved
before the KV pool is sized (`reserve_bytes`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from worker.torch_engine.decode_step import DecodeStep

logger = logging.getLogger(__name__)

# Reserved for the graph pool's own memory (the largest step's activations) beyond what is counted exactly: the
# step's gather buffers and the logits buffer every graph writes.
POOL_HEADROOM_BYTES = 512 << 20
# Decode steps run bucketed (and captured) up to this context; rows past it run packed, eagerly. The block tables
# and the gather buffers grow with it (vLLM's max_seq_len_to_capture was 8192 too).
GRAPH_MAX_CONTEXT = 8192
# RoPE variants that read the positions on the host to pick their frequencies: not capturable.
HOST_ROPE = ("dynamic", "longrope")


def graphs_refusal(device: torch.device, enforce_eager: bool, config=None) -> str | None:
    """Why decode steps are not captured here (None: they are); `config`: the language model's."""
    if enforce_eager:
        return "--enforce-eager"
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if any(kind in rope_type for kind in HOST_ROPE):
        return f"{rope_type} RoPE reads positions on the host, which a graph cannot"
    return None


def reserve_bytes(step_rows: int, max_context: int, block_size: int, bytes_per_position: int, vocab: int) -> int:
    """Device memory the graphs of a step of `step_rows` rows will take, to keep out of the KV pool:
    `bytes_per_position` is one layer's keys (or values) per position."""
    columns = max_context // block_size + 1
    return (2 * step_rows * columns * block_size * bytes_per_position + step_rows * vocab * 4
            + POOL_HEADROOM_BYTES)


@dataclass(frozen=True)
class CaptureReport:
    graphs: int
    seconds: float
    pool_bytes: int  # device memory the capture took (the graph pool and the gather buffers)


class DecodeGraphs:
    """The captured steps, by (rows, width); `replay` runs one over what the step's buffers hold now."""

    def __init__(self, step: DecodeStep):
        self.step = step
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # [rows, V] float32, written by every graph (made before capture)
        self.report: CaptureReport | None = None

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self._graphs

    def replay(self, rows: int, width: int) -> torch.Tensor:
        """Run the graph of bucket (rows, width); its logits [rows, V] float32, overwritten by the next replay."""
        self._graphs[rows, width].replay()
        return self.logits[:rows]

    @torch.inference_mode()
    def capture(self) -> CaptureReport | None:
        """Capture every (rows, width) bucket, the largest first, in one pool; the step replays them from now on.
        A capture that fails (an operation a graph cannot hold) is logged, and the steps run eagerly: None."""
        step = self.step
        if step.kernel:
            raise ValueError("decode graphs attend by gathering the block tables, not with the CPU's paged kernel")
        started = time.perf_counter()
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        step.own_gather_buffers()
        step.lora_always = step.lora_slots > 0
        self.logits = torch.empty(step.buckets[-1], step.model.config.get_text_config().vocab_size,
                                  dtype=torch.float32, device=step.cache.device)
        step.prepare([])  # every row padding: what the warm-ups and captures compute
        pool = None
        try:
            for rows in reversed(step.buckets):
                for width in reversed(step.widths):
                    step.forward(rows, width, step.lora_always)  # warm-up: lazily made kernels and workspaces
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self.logits[:rows].copy_(step.forward(rows, width, step.lora_always))
                    pool = graph.pool() if pool is None else pool
                    self._graphs[rows, width] = graph
            torch.cuda.synchronize()
        except RuntimeError as exc:
            logger.warning("decode steps run eagerly: capturing them as CUDA graphs failed: %s", exc)
            self._graphs.clear()
            step.gathered, step.lora_always = None, False
            return None
        self.report = CaptureReport(len(self._graphs), time.perf_counter() - started,
                                    free_before - torch.cuda.mem_get_info()[0])
        step.graphs = self
        logger.info("captured %d decode-step graphs (%d batch x %d context buckets) in %.1f s, %.0f MiB",
                    self.report.graphs, len(step.buckets), len(step.widths), self.report.seconds,
                    self.report.pool_bytes / 2**20)
        return self.report
