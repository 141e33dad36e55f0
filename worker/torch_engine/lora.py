"""LoRA adapters inside the packed forward: each target projection adds its rows' adapter deltas.

Every forward is one packed row of tokens from many requests: decode rows first (one token per sequence), then
prompt chunks; each request may run under its own adapter (or none). Each wrapped projection (`LoraLinear`)
keeps the resident adapters side by side, one place (slot) of `max_rank` rows each: A stacked as
[slots * max_rank, in], B (scaled) as [slots * max_rank, out], a smaller rank padded with zero rows.
- Decode rows, whatever adapters they mix: x @ A_all^T once, each row keeping only its own adapter's columns (a
  mask made once per forward from the rows' slots, as Punica's BGMV takes per-token indices), then @ B_all: three
  tensor operations per projection, nothing split per adapter.
- A prompt chunk runs under one adapter: its rows times that slot's rank rows alone (SGMV's segments), two
  operations, at the adapter's own rank.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from torch import nn

from adapters.peft_folder import TARGET_MODULES, AdapterError, AdapterRef, ModuleShape, read_adapter
from worker.engine.lora import LoraUnavailable

_current = threading.local()


class LoraLinear(nn.Module):
    """A target projection: the base Linear, plus each token's adapter delta from the stacked slots."""

    def __init__(self, base: nn.Linear, key: str, slots: int, max_rank: int):
        super().__init__()
        self.base = base
        self.key = key  # "layers.N.self_attn.q_proj": an adapter's weights for it are looked up by it
        self.max_rank = max_rank
        factory = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.a_all = torch.zeros(slots * max_rank, base.in_features, **factory)
        self.b_all = torch.zeros(slots * max_rank, base.out_features, **factory)
        self.ranks = [0] * slots  # each slot's adapter's rank here (0: it leaves this projection alone)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        plan = getattr(_current, "plan", None)
        if plan is None:
            return y
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        if plan.decode_mask is not None:
            nd = plan.num_decode
            flat_y[:nd].addmm_((flat_x[:nd] @ self.a_all.t()).mul_(plan.decode_mask), self.b_all)
        for start, end, slot in plan.segments:
            rank = self.ranks[slot]
            if rank:
                rows = slice(slot * self.max_rank, slot * self.max_rank + rank)
                flat_y[start:end].addmm_(flat_x[start:end] @ self.a_all[rows].t(), self.b_all[rows])
        return y

    def write_slot(self, slot: int, pair: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put an adapter's (A [r, in], B * scale [out, r]) in `slot` (None: it leaves this projection alone)."""
        rows = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        self.a_all[rows] = 0
        self.b_all[rows] = 0
        self.ranks[slot] = 0
        if pair is not None:
            a, b = pair
            r = a.shape[0]
            self.a_all[rows.start : rows.start + r] = a
            self.b_all[rows.start : rows.start + r] = b.t()
            self.ranks[slot] = r


@dataclass
class LoraPlan:
    """Which packed rows run under which adapter slot, made once per forward and read by every projection."""

    num_decode: int = 0
    decode_mask: torch.Tensor | None = None  # [num_decode, slots * max_rank]: each decode row's own columns
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (first row, end row, slot) of a chunk


def decode_mask(decode_slots: Sequence[int], num_slots: int, max_rank: int, device: torch.device,
                dtype: torch.dtype) -> torch.Tensor:
    """[rows, slots * max_rank]: 1 in the columns of each decode row's adapter slot (none for -1, the base model)."""
    columns = torch.arange(num_slots * max_rank, device=device) // max_rank
    index = torch.tensor(decode_slots, dtype=torch.long, device=device)
    return (columns.unsqueeze(0) == index.unsqueeze(1)).to(dtype)


class lora_plan:
    """Context manager: forwards inside it (on this thread) add each token's adapter delta as `plan` says (None:
    the base model's forward alone)."""

    def __init__(self, plan: LoraPlan | None):
        self.plan = plan

    def __enter__(self) -> None:
        _current.plan = self.plan

    def __exit__(self, *exc) -> None:
        _current.plan = None


class lora_rows(lora_plan):
    """The plan of one packed forward: `decode_slots`: per decode row, its adapter's slot (-1: the base model);
    `segments`: (first row, end row, slot) of each prompt chunk under an adapter. Neither: no plan."""

    def __init__(self, decode_slots: Sequence[int], segments: list[tuple[int, int, int]], max_rank: int,
                 num_slots: int, device: torch.device, dtype: torch.dtype):
        plan = None
        if segments or any(slot >= 0 for slot in decode_slots):
            plan = LoraPlan(len(decode_slots), segments=segments)
            if any(slot >= 0 for slot in decode_slots):
                plan.decode_mask = decode_mask(decode_slots, num_slots, max_rank, device, dtype)
        super().__init__(plan)


def wrap_projections(model: nn.Module, slots: int, max_rank: int) -> tuple[dict[str, ModuleShape], list[LoraLinear]]:
    """Replace each decoder layer's target projections with a LoraLinear of `slots` places of `max_rank` rows;
    their shapes by target name, and the wrappers."""
    shapes: dict[str, ModuleShape] = {}
    wrappers: list[LoraLinear] = []
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in TARGET_MODULES or not isinstance(module, nn.Linear) or ".layers." not in f".{name}":
            continue
        wrapper = LoraLinear(module, name[name.index("layers.") :], slots, max_rank)
        setattr(model.get_submodule(name.rsplit(".", 1)[0]), leaf, wrapper)
        wrappers.append(wrapper)
        shapes[leaf] = ModuleShape(module.in_features, module.out_features)
    return shapes, wrappers


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
