"""Between a transformers cache object and the per-layer (key, value) tensors that travel."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def cache_to_layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (key, value), each [batch, kv_heads, seq, head_dim]."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def layers_to_cache(layers: list[tuple[torch.Tensor, torch.Tensor]], config) -> DynamicCache:
    """A cache the model can continue from, holding exactly the given tensors."""
    return DynamicCache(ddp_cache_data=layers, config=config)
