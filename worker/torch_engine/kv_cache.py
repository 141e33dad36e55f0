"""The block pool's tensors: per layer, one key and one value tensor of [slots, kv_heads, head_dim] on the device.

A slot is `block * block_size + offset`; which blocks a sequence owns is the BlockPool's business.
Transferred caches are written straight into their sequence's slots and read out of them to be sent,
in the wire's per-layer [1, kv_heads, positions, head_dim] layout.
"""

from __future__ import annotations

import torch


class KvCache:
    """Per-layer key and value storage for `num_blocks` blocks of `block_size` positions."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_blocks * block_size, kv_heads, head_dim)
        # Attention reads whole blocks and masks the positions it must not see: those must hold finite numbers
        # (0 x NaN is NaN). On the host, fresh pages from the OS are zeros and only the model writes them after,
        # so the pool is left untouched until used; device memory may hold anything, so it is zeroed.
        make = torch.zeros if device.type != "cpu" else torch.empty
        self.keys = [make(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [make(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for t in self.keys + self.values:
            t[:block_size].zero_()  # block 0: the padding rows read
        self.block_size = block_size
        self.device = device

    def write(self, slots: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put a transferred cache ([1, kv_heads, n, head_dim] per layer) at `slots` ([n])."""
        slots = slots.to(self.device)
        for i, (k, v) in enumerate(layers):
            self.keys[i].index_copy_(0, slots, k[0].transpose(0, 1).to(self.device))
            self.values[i].index_copy_(0, slots, v[0].transpose(0, 1).to(self.device))

    def read(self, layer: int, slots: torch.Tensor, staging: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values at `slots`, as contiguous host tensors [1, kv_heads, n, head_dim]."""
        k = self.keys[layer][slots].permute(1, 0, 2).unsqueeze(0)
        v = self.values[layer][slots].permute(1, 0, 2).unsqueeze(0)
        if self.device.type == "cpu":
            return k.contiguous(), v.contiguous()
        # Staged through pinned host memory: the TCP and gRPC senders read host bytes.
        host_k = torch.empty(k.shape, dtype=k.dtype, pin_memory=True)
        host_v = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
        host_k.copy_(k)
        host_v.copy_(v)
        return host_k, host_v
