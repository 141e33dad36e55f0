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
        # Attention reads whole blocks and masks the positions it must not see, which must still hold finite numbers
        # (0 x NaN is NaN): a block is zeroed the first time it is handed out (`zero_blocks`), and after that only
        # the model writes it. Left empty until then, so the host pages of blocks never used are never touched.
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for t in self.keys + self.values:
            t[:block_size].zero_()  # block 0: the padding rows read
        self.block_size = block_size
        self.device = device
        # Where attention gathers a forward's blocks, kept across forwards: fresh memory for every layer's
        # gather costs a page fault per 4 KiB, several times the copy itself.
        self._gathered = [torch.empty(0, dtype=dtype, device=device), torch.empty(0, dtype=dtype, device=device)]

    def gather(self, pool: torch.Tensor, index: torch.Tensor, rows: int, which: int) -> torch.Tensor:
        """`pool` (a layer's keys or values) viewed as `rows`-position runs, the runs at `index`, into gather buffer
        `which` (0: keys, 1: values); valid until the next gather into the same buffer."""
        runs = pool.view(-1, rows, *pool.shape[1:])
        need = index.numel() * runs[0].numel()
        buf = self._gathered[which]
        if buf.numel() < need:
            buf = self._gathered[which] = torch.empty(need, dtype=pool.dtype, device=pool.device)
        out = buf[:need].view(index.numel(), *runs.shape[1:])
        return torch.index_select(runs, 0, index, out=out)

    def zero_blocks(self, blocks: list[int]) -> None:
        """Zero every layer's keys and values in `blocks` (blocks handed out for the first time)."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.device)
        for t in self.keys + self.values:
            t.view(-1, self.block_size, *t.shape[1:]).index_fill_(0, index, 0)

    def write(self, slots: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put a transferred cache ([1, kv_heads, n, head_dim] per layer) at `slots` ([n])."""
        slots = slots.to(self.device)
        for i, (k, v) in enumerate(layers):
            self.keys[i].index_copy_(0, slots, k[0].transpose(0, 1).to(self.device))
            self.values[i].index_copy_(0, slots, v[0].transpose(0, 1).to(self.device))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
