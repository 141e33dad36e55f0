"""The only torch-heavy module: loads a checkpoint and runs batched prefill and decode forwards."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.utils import logging as hf_logging

from worker.engine.batch_cache import BatchedKvCache
from worker.engine.sequence import Sequence

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

KvLayers = list[tuple[torch.Tensor, torch.Tensor]]
# Called from inside the forward as soon as layer `i` has its keys and values for every row.
LayerCallback = Callable[[int, torch.Tensor, torch.Tensor], None]


class LayerStreamingCache(DynamicCache):
    """A prefill cache that hands out each layer's keys and values the moment attention stores them."""

    def __init__(self, config, on_layer: LayerCallback | None):
        super().__init__(config=config)
        self._on_layer = on_layer

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self._on_layer is not None:
            self._on_layer(layer_idx, keys, values)
        return keys, values


class ModelRunner:
    """Owns the model, the tokenizer and the decode batch's cache; called only from engine threads."""

    def __init__(self, model_dir: Path | str, dtype: str = "auto"):
        self.model_dir = Path(model_dir)
        hf_logging.disable_progress_bar()  # keep worker logs quiet and line-structured
        kwargs = {} if dtype == "auto" else {"dtype": DTYPES[dtype]}
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, **kwargs).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.config = self.model.config
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_token_ids = frozenset(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        self.batch = BatchedKvCache(self.config)
        logger.info("loaded %s (%s, %s)", self.model_dir, type(self.model).__name__, self.model.dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def vocab_size(self) -> int:
        """The width of the logits (token ids a mask or a bias may name)."""
        return self.config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def kv_shape(self, seq_len: int) -> tuple[int, int, int, int]:
        """Shape of one layer's key (or value) tensor for one sequence of `seq_len` positions."""
        head_dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads
        kv_heads = getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads
        return (1, kv_heads, seq_len, head_dim)

    def kv_bytes_per_token(self) -> int:
        _, kv_heads, _, head_dim = self.kv_shape(1)
        return 2 * self.num_layers * kv_heads * head_dim * torch.empty(0, dtype=self.dtype).element_size()

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], on_layer: LayerCallback | None = None) -> tuple[torch.Tensor, list[KvLayers]]:
        """Run right-padded prompts in one forward; return last-position logits [B, V] and each row's KV."""
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        pad_id = self.tokenizer.pad_token_id or 0
        input_ids = torch.tensor([p + [pad_id] * (width - len(p)) for p in prompts], dtype=torch.long)
        mask = (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
        cache = LayerStreamingCache(self.config, on_layer)
        out = self.model(input_ids=input_ids, attention_mask=mask if len(prompts) > 1 else None,
                         past_key_values=cache, use_cache=True)
        last = torch.tensor(lengths) - 1
        logits = out.logits[torch.arange(len(prompts)), last].float()
        rows = [[(l.keys[r : r + 1, :, :n], l.values[r : r + 1, :, :n]) for l in cache.layers]
                for r, n in enumerate(lengths)]
        return logits, rows

    # Batch buffers may be (re)allocated during a decode forward, so every batch operation runs in
    # inference mode too: in-place writes to inference tensors are refused outside it.
    @torch.inference_mode()
    def join(self, seq: Sequence, layers: KvLayers) -> None:
        """Put a sequence's transferred cache into the decode batch."""
        self.batch.add(seq.request_id, layers)

    @torch.inference_mode()
    def leave(self, request_id: str) -> None:
        """Take a sequence out of the decode batch and drop its cache."""
        if request_id in self.batch.request_ids:
            self.batch.remove(request_id)

    def reset_batch(self) -> None:
        """Drop the whole decode batch (after a failed step left it in an unknown state)."""
        self.batch = BatchedKvCache(self.config)

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One batched decode step over every sequence in the batch; next-token logits [B, V], row i for seqs[i]."""
        by_id = {s.request_id: s for s in seqs}
        order = list(self.batch.request_ids)
        if set(order) != set(by_id) or len(order) != len(seqs):
            raise RuntimeError("decode batch and running sequences disagree")
        mask, positions = self.batch.step_inputs(order)
        input_ids = torch.tensor([[by_id[r].output_token_ids[-1]] for r in order], dtype=torch.long)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         past_key_values=self.batch.cache, use_cache=True)
        self.batch.cache = out.past_key_values
        self.batch.advance()
        logits = out.logits[:, -1].float()
        if all(r == s.request_id for r, s in zip(order, seqs)):
            return logits
        row_of = {r: i for i, r in enumerate(order)}
        return logits[torch.tensor([row_of[s.request_id] for s in seqs])]
