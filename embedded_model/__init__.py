"""The embedded default model: a tiny Llama checkpoint built offline, deterministically."""

from embedded_model.builder import ModelSpec, build_model, default_model_dir, ensure_default_model

__all__ = ["ModelSpec", "build_model", "default_model_dir", "ensure_default_model"]
