"""What a simulated worker pretends to be: how long its forwards take and how big its KV cache is."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kv_transfer.wire import DTYPE_SIZES, kv_tensor_shape

SIMULATED_MODEL = "simulated"  # the model name a simulated worker reports


@dataclass(frozen=True)
class CostModel:
    """Forward times in ms: a prefill is linear in its (padded) tokens, a decode step in its batch size."""

    prefill_base_ms: float = 1.0
    prefill_per_token_ms: float = 0.02
    decode_base_ms: float = 5.0
    decode_per_seq_ms: float = 0.05
    tier_load_per_block_ms: float = 0.01  # a block loaded from the KV tier instead of computed

    def __post_init__(self):
        for name in ("prefill_base_ms", "prefill_per_token_ms", "decode_base_ms", "decode_per_seq_ms",
                     "tier_load_per_block_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value} must be a finite number >= 0")

    def prefill_ms(self, num_tokens: int) -> float:
        return self.prefill_base_ms + self.prefill_per_token_ms * num_tokens

    def step_ms(self, batch_size: int) -> float:
        return self.decode_base_ms + self.decode_per_seq_ms * batch_size

    def tier_load_ms(self, num_blocks: int) -> float:
        return self.tier_load_per_block_ms * num_blocks


@dataclass(frozen=True)
class KvShape:
    """The simulated model's KV layout (defaults: the embedded pdserve-tiny, so tests move little data)."""

    num_layers: int = 2
    kv_heads: int = 2
    head_dim: int = 32
    dtype: str = "float16"

    def __post_init__(self):
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {sorted(DTYPE_SIZES)}")
        if min(self.num_layers, self.kv_heads, self.head_dim) <= 0:
            raise ValueError(f"layers, kv heads and head dim must be > 0, got {self}")

    def tensor_shape(self, seq_len: int) -> tuple[int, int, int]:
        """One layer's key (or value) for one sequence, as the real worker's header names it."""
        return kv_tensor_shape(seq_len, self.kv_heads, self.head_dim)

    def tensor_bytes(self, seq_len: int) -> int:
        return self.kv_heads * seq_len * self.head_dim * DTYPE_SIZES[self.dtype]

    def kv_bytes(self, seq_len: int) -> int:
        """Bytes of one prompt's whole cache: a key and a value per layer."""
        return 2 * self.num_layers * self.tensor_bytes(seq_len)
