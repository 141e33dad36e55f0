"""A decode step that is the same tensors every time, so that a CUDA graph captured once can replay it.

The life of one step of n decode rows (ModelRunner.forward hands it a step with no prompt chunks):
1. The rows are padded to the smallest batch bucket B >= n (`batch_buckets`); a step of more rows than the largest
   bucket, or of a row past the block tables' width, runs packed instead (ModelRunner's general forward). Where
   nothing is captured (the CPU, `--enforce-eager`) every size is its own bucket unless padding is asked for (the
   CPU suite asks, to check it): padding rows cost compute, and only a replay pays for them.
2. Their inputs are written into buffers made once, sized to the largest bucket: input ids, positions, slots,
   context lengths and block tables (one spare column), staged on the host and copied without blocking. A padding
   row reads token 0 at position 0, writes its key and value to the reserved dummy slot (slot 0: block 0, which no
   sequence is ever given) and attends a context of 1, that slot.
3. Attention reads a fixed width of W blocks per row (`context_buckets`: the smallest at or above the longest row's
   blocks), masked by the lengths on the device. On the CPU with the paged kernel, the kernel's plan (built on the
   host from the same padded rows) attends them instead.
4. On CUDA the forward of each (B, W) is a captured graph (decode_graphs.py), replayed; elsewhere, and with
   `--enforce-eager`, the same code runs eagerly, which is how the CPU suite checks the padding and the buffers.
5. The n real rows' logits are copied out of the step's output (a graph overwrites it at its next replay).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from worker.torch_engine.attention_plan import build_plan
from worker.torch_engine.kv_cache import KvCache
from worker.torch_engine.lora import LoraPlan, decode_mask, lora_plan
from worker.torch_engine.paged_attention import AttentionBatch, attention_batch

DUMMY_SLOT = 0  # in block 0, the pool's reserved block: padding rows write here and attend only it
MIN_CONTEXT_BLOCKS = 16  # the narrowest context bucket (256 positions at block size 16)


def batch_buckets(max_rows: int) -> tuple[int, ...]:
    """Batch sizes a step is padded to: 1, 2, 4, then every multiple of 8 up to `max_rows` (and `max_rows`), as
    vLLM's capture sizes go, so a step pads at most 7 rows."""
    sizes = {s for s in (1, 2, 4) if s <= max_rows} | set(range(8, max_rows + 1, 8)) | {max_rows}
    return tuple(sorted(sizes))


def context_buckets(max_blocks: int) -> tuple[int, ...]:
    """Block-table widths attention reads: powers of two from MIN_CONTEXT_BLOCKS, and `max_blocks` last."""
    widths, w = [], MIN_CONTEXT_BLOCKS
    while w < max_blocks:
        widths.append(w)
        w *= 2
    return (*widths, max_blocks)


def smallest_at_least(buckets: Sequence[int], n: int) -> int:
    return buckets[bisect.bisect_left(buckets, n)]


class StepBuffers:
    """The step's inputs, one tensor each for the largest bucket: written on the host (in pinned memory where there
    is a device to copy to) and copied to the device tensors a captured graph reads."""

    def __init__(self, rows: int, columns: int, lora_columns: int, device: torch.device, dtype: torch.dtype):
        self.device = device
        pinned = device.type == "cuda"

        def pair(*shape, kind=torch.long) -> tuple[torch.Tensor, torch.Tensor]:
            host = torch.zeros(shape, dtype=kind, pin_memory=pinned)
            return host, (host if device.type == "cpu" else torch.zeros(shape, dtype=kind, device=device))

        self.ids_host, self.ids = pair(1, rows)
        self.positions_host, self.positions = pair(1, rows)
        self.slots_host, self.slots = pair(rows)
        self.lengths_host, self.lengths = pair(rows)
        self.tables_host, self.tables = pair(rows, columns)
        self.lora_host, self.lora = pair(rows, lora_columns, kind=dtype)  # each row's adapter columns (lora.py)
        # Marks the last upload's copies done: the host writes the pinned buffers again only after it.
        self.uploaded = torch.cuda.Event() if pinned else None
        self.ids_np, self.positions_np = self.ids_host.numpy()[0], self.positions_host.numpy()[0]
        self.slots_np, self.lengths_np = self.slots_host.numpy(), self.lengths_host.numpy()
        self.tables_np = self.tables_host.numpy()

    def upload(self, rows: int, lora: bool) -> None:
        """Copy the first `rows` rows to the device without blocking the host: the copies queue on the stream ahead
        of the step that reads them."""
        if self.device.type == "cpu":
            return
        for host, dev in ((self.ids_host, self.ids), (self.positions_host, self.positions)):
            dev[:, :rows].copy_(host[:, :rows], non_blocking=True)
        # Whole rows of the tables: contiguous, one copy (a [rows, width] slice of each would be staged).
        for host, dev in ((self.slots_host, self.slots), (self.lengths_host, self.lengths),
                          (self.tables_host, self.tables)):
            dev[:rows].copy_(host[:rows], non_blocking=True)
        if lora:
            self.lora[:rows].copy_(self.lora_host[:rows], non_blocking=True)
        self.uploaded.record()

    def writable(self) -> None:
        """Wait until the last upload has read the pinned buffers (at once in practice: every step waits for its
        sampled tokens before the next is prepared)."""
        if self.uploaded is not None:
            self.uploaded.synchronize()


class DecodeStep:
    """Bucketed decode steps over one KV pool: the buffers, the padding, and the forward a graph captures."""

    def __init__(self, model, cache: KvCache, max_rows: int, max_context: int, kernel: bool,
                 lora_shape: tuple[int, int] = (0, 0), pad: bool = True):
        self.model, self.cache = model, cache
        self.block_size = bs = cache.block_size
        self.kernel = kernel  # the CPU's paged kernel attends (its own plan), not the gather over the tables
        # Unpadded (every size its own bucket) where nothing is captured: padding rows cost compute, and buy a replay.
        self.buckets = batch_buckets(max_rows) if pad else tuple(range(1, max_rows + 1))
        # A row at the context limit needs ceil(max_context / bs) blocks: one spare column holds it at any alignment.
        self.columns = max_context // bs + 1
        self.widths = context_buckets(self.columns)
        self.lora_slots, self.lora_rank = lora_shape
        device, dtype = cache.device, cache.keys[0].dtype
        self.buffers = StepBuffers(self.buckets[-1], self.columns, self.lora_slots * self.lora_rank, device, dtype)
        self.offsets = torch.arange(self.columns * bs, device=device)  # positions, compared with the lengths
        self.gathered: tuple[torch.Tensor, torch.Tensor] | None = None  # own gather buffers (`own_gather_buffers`)
        self.graphs = None  # DecodeGraphs once captured: replayed for the (rows, width) buckets they hold
        self.lora_always = False  # a captured step adds adapter deltas whatever its rows (zero columns for none)

    def fits(self, rows: Sequence) -> bool:
        """Whether a step of these decode rows runs bucketed: not more rows than the largest bucket, and every row's
        blocks inside the tables."""
        return len(rows) <= self.buckets[-1] and all(row.position // self.block_size < self.columns for row in rows)

    def own_gather_buffers(self) -> None:
        """Give the step gather buffers of its own, as large as its largest bucket reads: a captured graph keeps
        their addresses, which the pool's shared buffers (regrown by other forwards) would not."""
        pool = self.cache.keys[0]
        size = self.buckets[-1] * self.columns * self.block_size * pool[0].numel()
        self.gathered = tuple(torch.empty(size, dtype=pool.dtype, device=pool.device) for _ in range(2))

    def run(self, rows: Sequence, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits [len(rows), V] (float32, the caller's own) of one decode step over `rows` (DecodeRows that `fit`)."""
        n = len(rows)
        size, width, lora = self.prepare(rows)
        if self.graphs is not None and (size, width) in self.graphs:
            # A copy: the graphs' logits buffer is written again at the next replay. No `on_layer`: a replay runs
            # no Python (and on CUDA no receiver asks for blocks).
            return self.graphs.replay(size, width)[:n].clone()
        plan = None
        if self.kernel:
            block = self.block_size
            plan = build_plan([(row.table.block_ids[: row.position // block + 1], row.position) for row in rows]
                              + [((DUMMY_SLOT // block,), 0)] * (size - n), [], block)
        return self.forward(size, width, lora, plan, on_layer)[:n].float()  # an eager forward's own tensor

    def prepare(self, rows: Sequence) -> tuple[int, int, bool]:
        """Write `rows` and their padding into the buffers; (batch bucket, context bucket, adapters on)."""
        b, bs, n = self.buffers, self.block_size, len(rows)
        b.writable()
        size = smallest_at_least(self.buckets, n) if rows else self.buckets[-1]  # none: every row padding
        positions = [row.position for row in rows]
        blocks = [p // bs for p in positions]
        slots = [row.table.block_ids[k] * bs + p % bs for row, k, p in zip(rows, blocks, positions)]
        pad = size - n
        b.ids_np[:size] = [row.token_id for row in rows] + [0] * pad
        b.positions_np[:size] = positions + [0] * pad
        b.slots_np[:size] = slots + [DUMMY_SLOT] * pad
        b.lengths_np[:size] = [p + 1 for p in positions] + [1] * pad
        width = smallest_at_least(self.widths, max(blocks, default=0) + 1) if rows else self.widths[-1]
        if not self.kernel:
            b.tables_np[:size, :width] = DUMMY_SLOT // bs
            for i, (row, k) in enumerate(zip(rows, blocks)):
                b.tables_np[i, : k + 1] = row.table.block_ids[: k + 1]
        adapters = [row.lora.slot if row.lora is not None else -1 for row in rows]
        lora = self.lora_slots > 0 and (self.lora_always or any(slot >= 0 for slot in adapters))
        if lora:
            b.lora_host[:size] = decode_mask(adapters + [-1] * pad, self.lora_slots, self.lora_rank,
                                             torch.device("cpu"), b.lora_host.dtype)
        b.upload(size, lora)
        return size, width, lora

    def forward(self, size: int, width: int, lora: bool, plan=None,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """The model over the first `size` rows of the buffers, attending `width` blocks (or the kernel's `plan`);
        its logits [size, V]. A graph captures exactly this (with no plan and no `on_layer`)."""
        b = self.buffers
        batch = AttentionBatch(self.cache, slots=b.slots[:size], num_decode=size, on_layer=on_layer)
        if plan is not None:
            batch.kernel = plan
        else:
            batch.decode_blocks = b.tables[:size, :width].reshape(-1)
            batch.decode_mask = (self.offsets[: width * self.block_size] < b.lengths[:size, None])[:, None, None, :]
            batch.gathered = self.gathered
        adapters = LoraPlan(size, decode_mask=b.lora[:size]) if lora else None
        with attention_batch(batch), lora_plan(adapters):
            out = self.model(input_ids=b.ids[:, :size], position_ids=b.positions[:, :size], use_cache=False)
        return out.logits[0]
