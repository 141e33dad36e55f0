"""The only torch-heavy module: loads a checkpoint and runs prefill and decode forwards."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from worker.kv_cache import cache_to_layers, layers_to_cache
from worker.sequence import Sequence

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelRunner:
    """Owns the model and tokenizer of one worker; every call runs on the engine thread."""

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
        logger.info("loaded %s (%s, %s)", self.model_dir, type(self.model).__name__, self.model.dtype)

    @torch.inference_mode()
    def prefill(self, prompt_token_ids: list[int]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Run the prompt; return the last position's logits and the per-layer KV cache."""
        input_ids = torch.tensor([prompt_token_ids], dtype=torch.long)
        out = self.model(input_ids=input_ids, use_cache=True)
        return out.logits[0, -1].float(), cache_to_layers(out.past_key_values)

    def attach_kv(self, seq: Sequence, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Give a sequence the cache it will continue from."""
        seq.kv_cache = layers_to_cache(layers, self.config)

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        """One decode step for each sequence: feed its last token, return next-token logits."""
        logits = []
        for seq in seqs:
            input_ids = torch.tensor([[seq.output_token_ids[-1]]], dtype=torch.long)
            out = self.model(input_ids=input_ids, past_key_values=seq.kv_cache, use_cache=True)
            seq.kv_cache = out.past_key_values
            logits.append(out.logits[0, -1].float())
        return logits
