"""The decode batch's KV cache: preallocated per-layer buffers, rows joining and leaving freely.

Each layer owns one buffer [row slots, kv_heads, columns, head_dim]. Active rows fill slots
0..B-1; every row writes its next token at the shared column `end`, and row i's real tokens
occupy [start_i, end). Rows of different lengths are therefore left-padded, the pad masked out
and each row's positions counted from its own first token, so a sequence's attention sees
exactly its own keys whatever else is in the batch. Buffers leave slack on both sides, so a
step writes one column in place (no per-step concatenation), a longer newcomer moves the
window's left edge instead of shifting everyone, and a leaving row is replaced by the last one.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class _WindowLayer(DynamicLayer):
    """A cache layer whose keys/values are a window into the batch cache's buffers."""

    def __init__(self, owner: BatchedKvCache, index: int):
        super().__init__()
        self.owner = owner
        self.index = index
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.owner._write_step(self.index, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.owner.width

    @property
    def keys(self):
        return self.owner._window(self.index, False)

    @keys.setter
    def keys(self, value):  # DynamicLayer's constructor assigns these; the buffers are the truth
        pass

    @property
    def values(self):
        return self.owner._window(self.index, True)

    @values.setter
    def values(self, value):
        pass


class BatchedKvCache:
    """Rows of sequences in shared per-layer buffers, plus each row's start column and length."""

    def __init__(self, config, dtype: torch.dtype | None = None):
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.dtype = dtype
        self.request_ids: list[str] = []
        self.starts: list[int] = []
        self.lengths: list[int] = []
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self.begin = 0  # first column any active row uses
        self.end = 0  # next column to write
        self.cache: Cache | None = None
        self._like: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.request_ids)

    @property
    def width(self) -> int:
        return self.end - self.begin

    @property
    def pads(self) -> list[int]:
        return [s - self.begin for s in self.starts]

    # buffers -------------------------------------------------------------------------------
    def _allocate(self, slots: int, left: int, used: int, right: int, like: torch.Tensor) -> None:
        """(Re)allocate buffers with `left` free columns, the `used` window, and `right` free columns."""
        _, heads, _, head_dim = like.shape
        shape = (slots, heads, left + used + right, head_dim)
        new_k = [torch.zeros(shape, dtype=like.dtype) for _ in range(self.num_layers)]
        new_v = [torch.zeros(shape, dtype=like.dtype) for _ in range(self.num_layers)]
        rows = len(self.request_ids)
        if self._k and rows:
            for i in range(self.num_layers):
                new_k[i][:rows, :, left : left + used] = self._k[i][:rows, :, self.begin : self.end]
                new_v[i][:rows, :, left : left + used] = self._v[i][:rows, :, self.begin : self.end]
        shift = left - self.begin
        self.starts = [s + shift for s in self.starts]
        self.begin, self.end = left, left + used
        self._k, self._v = new_k, new_v
        self.cache = Cache(layers=[_WindowLayer(self, i) for i in range(self.num_layers)])

    @property
    def _slots(self) -> int:
        return self._k[0].shape[0] if self._k else 0

    def _window(self, layer: int, value: bool) -> torch.Tensor:
        buf = self._v[layer] if value else self._k[layer]
        return buf[: len(self.request_ids), :, self.begin : self.end]

    def _write_step(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        rows, n = keys.shape[0], keys.shape[2]
        self._k[layer][:rows, :, self.end : self.end + n] = keys
        self._v[layer][:rows, :, self.end : self.end + n] = values
        k = self._k[layer][:rows, :, self.begin : self.end + n]
        v = self._v[layer][:rows, :, self.begin : self.end + n]
        return k, v

    def _ensure_room(self, rows: int, width: int, right: int = 1) -> None:
        """Make room for `rows` slots, a window `width` columns wide, and `right` columns to write."""
        extra_left = width - self.width
        have_right = self._k[0].shape[2] - self.end
        if rows <= self._slots and extra_left <= self.begin and right <= have_right:
            if extra_left > 0:
                self.begin -= extra_left
            return
        slack = max(width, 16)
        self._allocate(max(rows, 2 * self._slots, 4), left=extra_left + slack, used=self.width,
                       right=max(right, slack, 64), like=self._like)
        self.begin -= extra_left

    # rows ------------------------------------------------------------------------------------
    def add(self, request_id: str, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append a row holding one sequence's cache ([1, kv_heads, n, head_dim] per layer)."""
        n = layers[0][0].shape[2]
        self._like = layers[0][0]
        if not self._k:
            self._allocate(4, left=max(n, 16), used=0, right=max(n, 64), like=self._like)
        self._ensure_room(len(self.request_ids) + 1, max(self.width, n))
        row = len(self.request_ids)
        start = self.end - n
        for i, (k, v) in enumerate(layers):
            self._k[i][row, :, self.begin : start] = 0
            self._v[i][row, :, self.begin : start] = 0
            self._k[i][row, :, start : self.end] = k[0]
            self._v[i][row, :, start : self.end] = v[0]
        self.request_ids.append(request_id)
        self.starts.append(start)
        self.lengths.append(n)

    def remove(self, request_id: str) -> None:
        """Drop a row (the last row moves into its slot), then narrow the window to what is used."""
        row = self.request_ids.index(request_id)
        last = len(self.request_ids) - 1
        if row != last:
            for i in range(self.num_layers):
                self._k[i][row] = self._k[i][last]
                self._v[i][row] = self._v[i][last]
            self.request_ids[row] = self.request_ids[last]
            self.starts[row] = self.starts[last]
            self.lengths[row] = self.lengths[last]
        self.request_ids.pop()
        self.starts.pop()
        self.lengths.pop()
        if self.request_ids:
            self.begin = min(self.starts)
        else:
            self._k, self._v, self.cache = [], [], None
            self.begin = self.end = 0

    def step_inputs(self, request_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention mask [B, width+1] and position ids [B, 1] for one decode step over all rows."""
        if request_ids != self.request_ids:
            raise RuntimeError("decode batch order differs from the cache's row order")
        self._ensure_room(len(self.request_ids), self.width, right=1)
        cols = torch.arange(self.width + 1)
        mask = (cols.unsqueeze(0) >= torch.tensor(self.pads).unsqueeze(1)).long()
        positions = torch.tensor(self.lengths).unsqueeze(1)
        return mask, positions

    def advance(self) -> None:
        """Record that every row grew by the token just decoded."""
        self.end += 1
        self.lengths = [n + 1 for n in self.lengths]
