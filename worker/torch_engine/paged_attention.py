"""Attention over the block pool, registered with transformers' attention interface as `pdserve_paged`.

Every forward is one packed row of tokens from many sequences ([1, T]): first one token per decoding
sequence, then chunks of prompts. The model computes q/k/v and rotary embeddings as it always does;
this function writes each layer's new keys and values into the pool at their slots and attends
each query over its own sequence's slots, so no KV is ever copied into a batch.

Two ways to attend, one answer: with a `KernelPlan` (the default on the CPU), decode rows and prompt chunks with
earlier positions are attended by the engine's kernel, which reads each sequence's blocks where they lie in the
pool (`kernels/paged_attention.cpp`; rows sharing leading blocks read them once per group), and a chunk that is
its whole context by SDPA over its own keys. Without one (the reference, and the CUDA path), decode rows are
attended together over their blocks gathered into a buffer (padded with the zero block, masked; the leading
blocks every row shares attended once) and each prompt chunk over its gathered context, causal from the lower right.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from worker.torch_engine.attention_plan import KernelPlan
from worker.torch_engine.kv_cache import KvCache

ATTENTION_NAME = "pdserve_paged"


@dataclass
class PrefillSegment:
    """One prompt chunk in the packed row: its query tokens [start, end) and the context it attends."""

    start: int
    end: int
    # Slots of every position of its sequence up to the chunk's end, attended causally from the lower right (the
    # chunk's last query sees the whole context); None: the chunk is the whole context, so it attends its own keys.
    context_slots: torch.Tensor | None = None


@dataclass
class AttentionBatch:
    """What one forward's attention needs beyond the model's own inputs; built once, read by every layer."""

    cache: KvCache
    slots: torch.Tensor  # [T]: where each token's key and value go
    num_decode: int = 0
    # Leading blocks every decode row holds (a shared system prompt): attended once for all rows; None: none.
    shared_blocks: torch.Tensor | None = None
    # [num_decode * blocks]: each decode row's blocks after the shared ones, padded with block 0.
    decode_blocks: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, blocks * block_size] bool: its positions among them
    # Where the decode rows' blocks are gathered, (keys, values); None: the pool's shared buffers. A captured decode
    # step (decode_step.py) has its own, whose addresses its graphs keep.
    gathered: tuple[torch.Tensor, torch.Tensor] | None = None
    segments: list[PrefillSegment] = field(default_factory=list)
    # With it, the kernel attends every decode row and every chunk not in `segments` (those are whole contexts).
    kernel: KernelPlan | None = None
    # Called as soon as layer i's keys and values are in the pool (the prefill worker streams them out).
    on_layer: Callable[[int], None] | None = None


_current = threading.local()


class attention_batch:
    """Context manager: the forwards run inside it (on this thread) attend with `batch`."""

    def __init__(self, batch: AttentionBatch):
        self.batch = batch

    def __enter__(self) -> AttentionBatch:
        _current.batch = self.batch
        return self.batch

    def __exit__(self, *exc) -> None:
        _current.batch = None


def paged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                    scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] (rotary applied); returns ([1, T, Hq, D], None)."""
    batch: AttentionBatch | None = getattr(_current, "batch", None)
    if batch is None:  # a plain forward (e.g. `generate` on the loaded model): ordinary causal attention
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    layer = module.layer_idx
    k_pool, v_pool = batch.cache.keys[layer], batch.cache.values[layer]  # [slots, Hkv, D]
    k_pool.index_copy_(0, batch.slots, key[0].transpose(0, 1))
    v_pool.index_copy_(0, batch.slots, value[0].transpose(0, 1))
    if batch.on_layer is not None:
        batch.on_layer(layer)
    hq, hkv, d = query.shape[1], key.shape[1], query.shape[3]
    nd = batch.num_decode
    if batch.kernel is not None:
        plan = batch.kernel
        queries = query[0].transpose(0, 1).contiguous()  # [T, Hq, D]
        out = torch.empty_like(queries)
        torch.ops.pdserve.paged_attention(out, queries, k_pool, v_pool, plan.tables, plan.queries, plan.items,
                                          scaling if scaling is not None else d ** -0.5, batch.cache.block_size)
        nd = 0  # the kernel attended them
    else:
        out = query.new_empty(query.shape[2], hq, d)
    if nd:
        # GQA with one query per row: the group's query heads become the "query length" of their kv head.
        q = query[0, :, :nd].transpose(0, 1).reshape(nd, hkv, hq // hkv, d)
        # Whole blocks gathered (a copy of contiguous 16-position runs, far cheaper than position by position);
        # the positions past each row's length are masked out.
        cache, bs = batch.cache, batch.cache.block_size
        if batch.shared_blocks is None:
            into = batch.gathered or (None, None)
            k = cache.gather(k_pool, batch.decode_blocks, bs, 0, into[0]).view(nd, -1, hkv, d).transpose(1, 2)
            v = cache.gather(v_pool, batch.decode_blocks, bs, 1, into[1]).view(nd, -1, hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.decode_mask, scale=scaling)
        else:
            o = _cascade(q * (scaling if scaling is not None else d ** -0.5), k_pool, v_pool, batch)
        out[:nd] = o.reshape(nd, hq, d)
    for seg in batch.segments:
        q = query[:, :, seg.start : seg.end]
        if seg.context_slots is None:
            k, v = key[:, :, seg.start : seg.end], value[:, :, seg.start : seg.end]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=hq != hkv)
        else:
            k = batch.cache.gather(k_pool, seg.context_slots, 1, 0).view(-1, hkv, d).transpose(0, 1).unsqueeze(0)
            v = batch.cache.gather(v_pool, seg.context_slots, 1, 1).view(-1, hkv, d).transpose(0, 1).unsqueeze(0)
            if hq != hkv:  # the fused kernels a lower-right bias dispatches to take as many kv heads as query heads
                k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
            bias = causal_lower_right(q.shape[2], k.shape[2])  # no mask tensor: flash / efficient kernels on a GPU
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scaling)
        out[seg.start : seg.end] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _cascade(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
    """Decode attention for rows that share leading blocks: the shared positions are read once and attended by
    every row's (scaled) queries together, each row's own blocks separately; the two softmax parts are merged by
    their maxima and sums. q [nd, Hkv, G, D] -> [nd, Hkv, G, D]."""
    nd, hkv, g, d = q.shape
    cache, bs = batch.cache, batch.cache.block_size
    ks = cache.gather(k_pool, batch.shared_blocks, bs, 0).view(-1, hkv, d).permute(1, 2, 0)  # [Hkv, D, P]
    vs = cache.gather(v_pool, batch.shared_blocks, bs, 1).view(-1, hkv, d).transpose(0, 1)  # [Hkv, P, D]
    scores = torch.matmul(q.transpose(0, 1).reshape(hkv, nd * g, d), ks)  # [Hkv, nd*G, P]
    shared = _softmax_parts(scores, vs)
    shared = [t.view(hkv, nd, g, -1).transpose(0, 1) for t in shared]  # [nd, Hkv, G, *]
    kt = cache.gather(k_pool, batch.decode_blocks, bs, 0).view(nd, -1, hkv, d).permute(0, 2, 3, 1)  # [nd, Hkv, D, W]
    vt = cache.gather(v_pool, batch.decode_blocks, bs, 1).view(nd, -1, hkv, d).transpose(1, 2)  # [nd, Hkv, W, D]
    scores = torch.matmul(q, kt).masked_fill_(~batch.decode_mask, float("-inf"))  # [nd, Hkv, G, W]
    own = _softmax_parts(scores, vt)
    (m1, l1, o1), (m2, l2, o2) = shared, own
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
    return (o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2)


def _softmax_parts(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, sum of exp, unnormalised output) of softmax(scores) @ values over the last axis."""
    m = scores.amax(-1, keepdim=True)
    e = torch.exp(scores - m)
    return m, e.sum(-1, keepdim=True), torch.matmul(e, values)


AttentionInterface.register(ATTENTION_NAME, paged_attention)
