"""PEFT LoRA adapters for a checkpoint, built offline and deterministically (tests and benchmarks).

`peft` (a test extra) makes each adapter as a user's training run would save it: `adapter_config.json` +
`adapter_model.safetensors`. B is initialised non-zero (and scaled down so the output stays fluent), so every
adapter changes greedy output and no two agree.

    python -m embedded_model.lora_adapters --model DIR --out DIR [--count 4] [--rank 8]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapter(model_dir: str | Path, out: str | Path, seed: int, rank: int = 8,
                  targets: list[str] | None = None, b_scale: float = 0.5) -> Path:
    """One adapter of `model_dir` into `out` (made from `seed`); returns `out`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                                            target_modules=targets or ALL_PROJECTIONS))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    model.save_pretrained(out)
    return Path(out)


def build_adapters(model_dir: str | Path, out_dir: str | Path, count: int = 4, rank: int = 8,
                   b_scale: float = 0.5) -> dict[str, Path]:
    """`count` adapters named a1, a2, ... under `out_dir` (built once: an existing folder is kept; each is built
    aside and renamed into place, so processes building at once never see half a folder)."""
    adapters = {}
    for i in range(1, count + 1):
        path = Path(out_dir) / f"a{i}"
        if not (path / "adapter_model.safetensors").is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            aside = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".a{i}-"))
            build_adapter(model_dir, aside, seed=1000 + i, rank=rank, b_scale=b_scale)
            try:
                os.rename(aside, path)
            except OSError:  # another process put it there first
                shutil.rmtree(aside, ignore_errors=True)
        adapters[f"a{i}"] = path
    return adapters


def embedded_adapters(count: int = 3) -> dict[str, Path]:
    """Adapters a1 ... a`count` of the embedded model, built on first use beside it."""
    from embedded_model import ensure_default_model

    model_dir = ensure_default_model()
    return build_adapters(model_dir, model_dir.parent / f"{model_dir.name}-loras", count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the checkpoint folder the adapters are for")
    parser.add_argument("--out", required=True, help="folder to put adapters a1 ... aN in")
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--b-scale", type=float, default=0.5, help="B's initial values are scaled by this")
    args = parser.parse_args()
    for name, path in build_adapters(args.model, args.out, args.count, args.rank, args.b_scale).items():
        print(f"{name}={path}")


if __name__ == "__main__":
    main()
