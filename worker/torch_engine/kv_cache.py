"""The block pool's tensors: per layer, one key and one value tensor of [slots, kv_heads, head_dim] on the device.

A slot is `block * block_size + offset`; which blocks a sequence owns is the BlockPool's business.
The wire's layout is the pool's (per layer, [positions, kv_heads, head_dim]): a prompt's KV is read out
of its slots with one gather to be sent, and a decode worker on the CPU receives a cache straight into
its blocks' memory (`block_runs`); `write` copies one that came into a receive buffer instead.
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

    def gather(self, pool: torch.Tensor, index: torch.Tensor, rows: int, which: int,
               into: torch.Tensor | None = None) -> torch.Tensor:
        """`pool` (a layer's keys or values) viewed as `rows`-position runs, the runs at `index`, into gather buffer
        `which` (0: keys, 1: values), or `into` (a caller's own, large enough); valid until the next gather there."""
        runs = pool.view(-1, rows, *pool.shape[1:])
        need = index.numel() * runs[0].numel()
        buf = self._gathered[which] if into is None else into
        if into is None and buf.numel() < need:
            buf = self._gathered[which] = torch.empty(need, dtype=pool.dtype, device=pool.device)
        out = buf[:need].view(index.numel(), *runs.shape[1:])
        return torch.index_select(runs, 0, index, out=out)

    def zero_blocks(self, blocks: list[int]) -> None:
        """Zero every layer's keys and values in `blocks` (blocks handed out for the first time)."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.device)
        for t in self.keys + self.values:
            t.view(-1, self.block_size, *t.shape[1:]).index_fill_(0, index, 0)

    def write(self, slots: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put a transferred cache ([n, kv_heads, head_dim] per layer, the pool's own layout) at `slots` ([n]): the
        copy a cache received into a receive buffer takes when its sequence joins (`block_runs` avoids it)."""
        slots = slots.to(self.device)
        for i, (k, v) in enumerate(layers):
            self.keys[i].index_copy_(0, slots, k.to(self.device))
            self.values[i].index_copy_(0, slots, v.to(self.device))

    # one block as bytes, for the KV tier (worker/engine/kv_tier.py's BlockBytes) --------------------------------
    @property
    def block_bytes(self) -> int:
        """Bytes of one block: every layer's keys and values."""
        t = self.keys[0]
        return 2 * len(self.keys) * self.block_size * t[0].numel() * t.element_size()

    def read_block(self, block: int) -> bytearray:
        """A copy of `block`'s keys and values, layer by layer (keys, then values), as host bytes."""
        out = bytearray(self.block_bytes)
        self._copy_block(block, torch.frombuffer(out, dtype=torch.uint8), out_of_pool=True)
        return out

    def write_block(self, block: int, data: bytearray) -> None:
        """Put bytes `read_block` gave (a writable buffer: no copy is made of it) into `block`."""
        self._copy_block(block, torch.frombuffer(data, dtype=torch.uint8), out_of_pool=False)

    def _copy_block(self, block: int, flat: torch.Tensor, out_of_pool: bool) -> None:
        span = slice(block * self.block_size, (block + 1) * self.block_size)
        offset = 0
        for pair in zip(self.keys, self.values):
            for t in pair:
                rows = t[span].reshape(-1).view(torch.uint8)
                piece = flat[offset:offset + rows.numel()]
                if out_of_pool:
                    piece.copy_(rows)
                else:
                    rows.copy_(piece)
                offset += rows.numel()

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values at `slots`, as contiguous host tensors [n, kv_heads, head_dim] (the
        wire's layout is the pool's: one gather, no permute)."""
        k = self.keys[layer][slots]
        v = self.values[layer][slots]
        if self.device.type == "cpu":
            return k, v
        # Staged through pinned host memory: the TCP and gRPC senders read host bytes.
        host_k = torch.empty(k.shape, dtype=k.dtype, pin_memory=True)
        host_v = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
        host_k.copy_(k)
        host_v.copy_(v)
        return host_k, host_v

    def block_runs(self, block_ids: list[int], num_positions: int) -> list[list[memoryview]]:
        """Writable memoryviews over the slots of `block_ids` (in position order) that hold `num_positions`
        positions, per tensor in a KV stream's order (index 2 * layer + is_value): a view per stretch of consecutive
        blocks, whose bytes are the stream's for those positions, so a cache can be received straight into the pool.
        CPU only (the memory must be the host's)."""
        if self.device.type != "cpu":
            raise ValueError(f"a KV cache on {self.device} cannot be received into: its memory is not the host's")
        stretches: list[list[int]] = []  # [first block, blocks]
        for block in block_ids:
            if stretches and stretches[-1][0] + stretches[-1][1] == block:
                stretches[-1][1] += 1
            else:
                stretches.append([block, 1])
        runs = []
        for i in range(2 * len(self.keys)):
            pool = (self.values if i % 2 else self.keys)[i // 2]
            raw = memoryview(pool.view(torch.uint8).reshape(-1).numpy())
            row = len(raw) // pool.shape[0]  # bytes of one slot
            left = num_positions * row
            tensor_runs = []
            for first, count in stretches:
                size = min(count * self.block_size * row, left)
                start = first * self.block_size * row
                tensor_runs.append(raw[start : start + size])
                left -= size
            runs.append(tensor_runs)
        return runs
