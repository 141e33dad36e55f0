"""The decode batch's KV cache: one left-padded tensor per layer, rows joining and leaving freely.

Rows have different lengths; each is right-aligned in a shared length L, its leading pad
columns masked out, and its positions counted from its own first real token. So a sequence's
attention sees exactly its own keys, whatever else is in the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from worker.kv_cache import layers_to_cache


class BatchedKvCache:
    """Per-layer [batch, kv_heads, L, head_dim] tensors plus each row's pad and real length."""

    def __init__(self, config):
        self.config = config
        self.request_ids: list[str] = []
        self.pads: list[int] = []
        self.lengths: list[int] = []
        self.cache: DynamicCache | None = None

    @property
    def width(self) -> int:
        return 0 if self.cache is None else self.cache.layers[0].keys.shape[2]

    def __len__(self) -> int:
        return len(self.request_ids)

    def _tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    def add(self, request_id: str, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append a row holding one sequence's cache ([1, kv_heads, n, head_dim] per layer)."""
        n = layers[0][0].shape[2]
        if self.cache is None:
            self.cache = layers_to_cache([(k.clone(), v.clone()) for k, v in layers], self.config)
            self.request_ids, self.pads, self.lengths = [request_id], [0], [n]
            return
        width = self.width
        if n > width:  # widen everyone already here
            grow = n - width
            current = [(F.pad(k, (0, 0, grow, 0)), F.pad(v, (0, 0, grow, 0))) for k, v in self._tensors()]
            self.pads = [p + grow for p in self.pads]
            width = n
        else:
            current = self._tensors()
        pad = width - n
        merged = [
            (torch.cat([k, F.pad(nk, (0, 0, pad, 0))]), torch.cat([v, F.pad(nv, (0, 0, pad, 0))]))
            for (k, v), (nk, nv) in zip(current, layers)
        ]
        self.cache = layers_to_cache(merged, self.config)
        self.request_ids.append(request_id)
        self.pads.append(pad)
        self.lengths.append(n)

    def remove(self, request_id: str) -> None:
        """Drop a row, then trim pad columns that no remaining row needs."""
        index = self.request_ids.index(request_id)
        del self.request_ids[index], self.pads[index], self.lengths[index]
        if not self.request_ids:
            self.cache = None
            return
        keep = torch.tensor([i for i in range(len(self.request_ids) + 1) if i != index])
        trim = min(self.pads)
        tensors = [(k.index_select(0, keep)[:, :, trim:], v.index_select(0, keep)[:, :, trim:])
                   for k, v in self._tensors()]
        self.cache = layers_to_cache(tensors, self.config)
        self.pads = [p - trim for p in self.pads]

    def step_inputs(self, request_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention mask [B, L+1] and position ids [B, 1] for one decode step over all rows."""
        if request_ids != self.request_ids:
            raise RuntimeError("decode batch order differs from the cache's row order")
        width = self.width
        cols = torch.arange(width + 1)
        mask = (cols.unsqueeze(0) >= torch.tensor(self.pads).unsqueeze(1)).long()
        positions = torch.tensor(self.lengths).unsqueeze(1)
        return mask, positions

    def advance(self) -> None:
        """Record that every row grew by the token just decoded."""
        self.lengths = [n + 1 for n in self.lengths]

    def row_layers(self, request_id: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One row's real keys and values (for tests and inspection)."""
        i = self.request_ids.index(request_id)
        p = self.pads[i]
        return [(k[i : i + 1, :, p:], v[i : i + 1, :, p:]) for k, v in self._tensors()]
