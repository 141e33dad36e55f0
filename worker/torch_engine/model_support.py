"""What the runner serves, settled at start-up: the device, the attention backend, and the architectures it refuses
by name (rather than serve wrong tokens)."""

from __future__ import annotations

import logging

import torch

from worker.torch_engine import kernels

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """`auto`: the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is available here")
    return device


ATTENTION_BACKENDS = ("auto", "kernel", "torch")


def resolve_attention(name: str, device: torch.device) -> str:
    """`kernel` (the engine's paged kernel: CPU only, built here by the C++ compiler) or `torch` (gathers blocks,
    then SDPA: the reference, and the CUDA path); `auto`: the kernel on the CPU when it builds, else torch."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention {name}: must be one of {', '.join(ATTENTION_BACKENDS)}")
    if name == "torch" or (name == "auto" and device.type != "cpu"):
        return "torch"
    if device.type != "cpu":
        raise ValueError(f"--attention kernel: the paged kernel runs on the CPU only, not {device.type} "
                         "(use --attention torch or auto)")
    try:
        kernels.load()
    except kernels.KernelUnavailable as exc:
        if name == "kernel":
            raise ValueError(f"--attention kernel: {exc}") from exc
        logger.warning("paged-attention kernel unavailable, attending with torch (gathers blocks): %s", exc)
        return "torch"
    return "kernel"


def refuse_unsupported_attention(config) -> None:
    """Fail at start-up, naming the setting, for attention the paged function does not compute (rather than serve
    wrong tokens): sliding windows and logit soft-capping."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    if (window and getattr(config, "use_sliding_window", True) is not False) or "sliding_attention" in layer_types:
        raise ValueError(f"{config.model_type}: sliding-window attention (sliding_window={window}) is not supported "
                         "by pdserve's paged attention yet")
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError(f"{config.model_type}: attention logit soft-capping is not supported by pdserve's paged "
                         "attention yet")


SERVED_VISION_MODELS = frozenset({"llava"})


def refuse_unsupported_vision(config) -> None:
    """Fail at start-up, naming the reason, for a vision-language architecture the runner was not built for: only
    LLaVA's is served (one position per token, fixed-size images, causal attention over them). Others need what it
    lacks: multimodal rotary positions (Qwen2-VL), image sizes for tiling (LLaVA-NeXT), bidirectional attention
    over the image prefix (PaliGemma)."""
    if config.model_type not in SERVED_VISION_MODELS:
        raise ValueError(f"{config.model_type}: of vision-language models only {sorted(SERVED_VISION_MODELS)} "
                         "(one position per token, fixed-size images) are served yet")
