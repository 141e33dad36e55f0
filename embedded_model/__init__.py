"""The embedded default models, built offline, deterministically: a tiny Llama checkpoint (`builder.py`) and a tiny
LLaVA vision-language one over it (`vlm_builder.py`)."""

from embedded_model.builder import ModelSpec, build_model, default_model_dir, ensure_default_model
from embedded_model.vlm_builder import VlmSpec, build_vlm, default_vlm_dir, ensure_default_vlm

__all__ = ["ModelSpec", "VlmSpec", "build_model", "build_vlm", "default_model_dir", "default_vlm_dir",
           "ensure_default_model", "ensure_default_vlm"]
