"""LoRA adapters inside the packed forward: each target projection adds its rows' adapter deltas.

Every forward is one packed row of tokens from many requests; each request may run under its own adapter (or
none). `LoraLinear` wraps a projection: the base Linear runs on the whole row once, then for each adapter present
in the forward its tokens' rows (per-token adapter indices, as Punica's segmented kernels take them) get
x @ A^T @ (B * scale)^T added. One step mixes base requests and several adapters; nothing is split per adapter.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from safetensors import safe_open
from torch import nn

from adapters.peft_folder import TARGET_MODULES, AdapterError, ModuleShape, read_adapter
from worker.engine.lora import LoadedLora, AdapterRef, LoraUnavailable

_current = threading.local()


class LoraLinear(nn.Module):
    """A target projection: the base Linear, plus each present adapter's delta on its own tokens' rows."""

    def __init__(self, base: nn.Linear, key: str):
        super().__init__()
        self.base = base
        self.key = key  # "layers.N.self_attn.q_proj": the adapters' weights are looked up by it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        segments = getattr(_current, "segments", None)
        if not segments:
            return y
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        for rows, lora in segments:
            pair = lora.weights.get(self.key)
            if pair is None:
                continue
            a, b = pair
            if rows is None:  # every token of the forward runs under this adapter
                flat_y += (flat_x @ a.t()) @ b.t()
            else:
                flat_y.index_add_(0, rows, (flat_x.index_select(0, rows) @ a.t()) @ b.t())
        return y


class lora_rows:
    """Context manager: forwards inside it (on this thread) add each adapter's delta to its token rows.
    `adapters`: per packed token, the LoadedLora it runs under or None."""

    def __init__(self, adapters: Sequence[LoadedLora | None], device: torch.device):
        self.segments = _segments(adapters, device)

    def __enter__(self) -> None:
        _current.segments = self.segments

    def __exit__(self, *exc) -> None:
        _current.segments = None


def _segments(adapters: Sequence[LoadedLora | None], device: torch.device) -> list:
    by_lora: dict[int, tuple[LoadedLora, list[int]]] = {}
    for i, lora in enumerate(adapters):
        if lora is not None:
            by_lora.setdefault(id(lora), (lora, []))[1].append(i)
    segments = []
    for lora, rows in by_lora.values():
        whole = len(rows) == len(adapters)
        segments.append((None if whole else torch.tensor(rows, dtype=torch.long, device=device), lora))
    return segments


def wrap_projections(model: nn.Module) -> dict[str, ModuleShape]:
    """Replace each decoder layer's target projections with a LoraLinear; their shapes by target name."""
    shapes: dict[str, ModuleShape] = {}
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in TARGET_MODULES or not isinstance(module, nn.Linear) or ".layers." not in f".{name}":
            continue
        key = name[name.index("layers.") :]
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        setattr(parent, leaf, LoraLinear(module, key))
        shapes[leaf] = ModuleShape(module.in_features, module.out_features)
    return shapes


def load_lora_weights(ref: AdapterRef, shapes: dict[str, ModuleShape], num_layers: int, max_rank: int,
                      device: torch.device, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """An adapter's (A, B * scale) per projection key, on the device; LoraUnavailable when this worker cannot load
    it: its folder missing or unreadable here, not what the coordinator checked (another identity), beyond this
    worker's rank limit, or too big for the device's memory. Whatever the cause, only that request fails here."""
    try:
        adapter = read_adapter(ref.path, shapes, num_layers, max_rank)
        if adapter.digest != ref.digest:
            raise LoraUnavailable(f"LoRA adapter {ref.name!r}: {ref.path} on this worker differs from the "
                                  "coordinator's (another identity)")
        weights = {}
        with safe_open(adapter.path / "adapter_model.safetensors", framework="pt") as f:
            for t in adapter.tensors:
                a = f.get_tensor(t.a_key).to(device=device, dtype=dtype).contiguous()
                b = (f.get_tensor(t.b_key).float() * adapter.scaling).to(device=device, dtype=dtype).contiguous()
                weights[t.module] = (a, b)
        return weights
    except LoraUnavailable:
        raise
    except AdapterError as exc:
        raise LoraUnavailable(f"LoRA adapter {ref.name!r}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 (a file cut short, a device out of memory: this request's, not the worker's)
        raise LoraUnavailable(f"LoRA adapter {ref.name!r}: loading {ref.path} failed: {exc}") from None
