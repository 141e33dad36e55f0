"""A PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`), checked against a model without
loading a tensor, and its identity (no torch).

Read once by the coordinator when an adapter is configured or loaded (a 400 naming the file or key) and again by
each worker that loads it, which then reads the tensors the check listed. The identity is the xxh3-128 of both
files: it salts the prompt's block hashes, so a changed folder under the same name never hits the old KV.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections a LoRA may adapt: attention and MLP of a Llama-style decoder layer.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PREFIX = "base_model.model."
# PEFT options that change the computation beyond x @ A^T @ B^T * scale; refused rather than ignored.
_REFUSED_OPTIONS = {"use_dora": False, "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
                    "alpha_pattern": {}, "fan_in_fan_out": False, "bias": "none", "layer_replication": None,
                    "use_qalora": False, "trainable_token_indices": None, "target_parameters": None}


class AdapterError(ValueError):
    """A folder that is not a LoRA adapter this model can serve; the message names the file or key."""


@dataclass(frozen=True)
class AdapterRef:
    """An adapter as a request carries it, coordinator and workers alike: its served name, its folder and its
    identity (`adapter_digest`)."""

    name: str
    path: str
    digest: int


@dataclass(frozen=True)
class ModuleShape:
    """One adapted projection of the model: a Linear from `in_features` to `out_features`."""

    in_features: int
    out_features: int


def model_module_shapes(config) -> dict[str, ModuleShape]:
    """Each target projection's shape in a Llama-style decoder layer of a transformers text `config`."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return {"q_proj": ModuleShape(hidden, heads * head_dim), "k_proj": ModuleShape(hidden, kv_heads * head_dim),
            "v_proj": ModuleShape(hidden, kv_heads * head_dim), "o_proj": ModuleShape(heads * head_dim, hidden),
            "gate_proj": ModuleShape(hidden, inter), "up_proj": ModuleShape(hidden, inter),
            "down_proj": ModuleShape(inter, hidden)}


@dataclass(frozen=True)
class AdapterTensors:
    """Where one projection's pair lives in the weights file: `layers.N.self_attn.q_proj` (the model's own module
    path below its decoder) -> the file's A and B keys."""

    module: str
    a_key: str
    b_key: str


@dataclass(frozen=True)
class PeftAdapter:
    """A checked adapter folder: its rank, scale, the projections it adapts and its identity."""

    path: Path
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    tensors: tuple[AdapterTensors, ...]
    digest: int

    @property
    def digest_bytes(self) -> bytes:
        return self.digest.to_bytes(16, "little")


def adapter_digest(config_bytes: bytes, weights_bytes: bytes) -> int:
    """An adapter's identity: xxh3-128 over its config file and its weights file."""
    h = xxhash.xxh3_128()
    h.update(len(config_bytes).to_bytes(8, "little"))
    h.update(config_bytes)
    h.update(weights_bytes)
    return h.intdigest()


def _safetensors_header(data: bytes, where: Path) -> dict:
    if len(data) < 8:
        raise AdapterError(f"{where}: not a safetensors file (too short)")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise AdapterError(f"{where}: not a safetensors file (header of {size} bytes past the end)")
    try:
        header = json.loads(data[8 : 8 + size])
    except ValueError as exc:
        raise AdapterError(f"{where}: not a safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    body = len(data) - 8 - size
    for key, info in header.items():
        shape, offsets = info.get("shape") if isinstance(info, dict) else None, \
            info.get("data_offsets") if isinstance(info, dict) else None
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets) or not 0 <= offsets[0] <= offsets[1] <= body
                or info.get("dtype") not in _DTYPE_BYTES
                or offsets[1] - offsets[0] != _DTYPE_BYTES[info["dtype"]] * _product(shape)):
            raise AdapterError(f"{where}: tensor {key!r} is malformed or truncated (shape, dtype or data offsets "
                               "do not fit the file)")
    return header


_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}


def _product(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def read_adapter(folder: str | Path, modules: dict[str, ModuleShape], num_layers: int, max_rank: int) -> PeftAdapter:
    """The adapter in `folder`, checked against a model's projection shapes and layer count and the rank limit;
    AdapterError naming the file or key otherwise."""
    path = Path(folder)
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not path.is_dir():
        raise AdapterError(f"{path}: no such adapter folder")
    for f in (config_path, weights_path):
        if not f.is_file():
            raise AdapterError(f"{f}: missing (a PEFT LoRA folder holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    config_bytes, weights_bytes = config_path.read_bytes(), weights_path.read_bytes()
    try:
        config = json.loads(config_bytes)
    except ValueError as exc:
        raise AdapterError(f"{config_path}: not JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise AdapterError(f"{config_path}: peft_type must be \"LORA\", got {config.get('peft_type')!r}"
                           if isinstance(config, dict) else f"{config_path}: not a JSON object")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or not 0 < rank <= max_rank:
        raise AdapterError(f"{config_path}: r={rank!r} must be an integer in [1, {max_rank}] (--max-lora-rank)")
    if not isinstance(alpha, (int, float)):
        raise AdapterError(f"{config_path}: lora_alpha must be a number, got {alpha!r}")
    for key, plain in _REFUSED_OPTIONS.items():
        value = config.get(key, plain)
        if value not in (plain, None, False, {}, [], "none"):
            raise AdapterError(f"{config_path}: {key}={value!r} is not supported (only {plain!r})")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [m for m in TARGET_MODULES if m == targets]
        if not targets:
            raise AdapterError(f"{config_path}: target_modules={config['target_modules']!r} must list projections "
                               f"of {list(TARGET_MODULES)}")
    if not isinstance(targets, list) or not targets:
        raise AdapterError(f"{config_path}: target_modules must be a non-empty list, got {targets!r}")
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise AdapterError(f"{config_path}: target_modules {unknown} are not modules of this model; LoRA applies to "
                           f"{list(TARGET_MODULES)}")
    scaling = alpha / (rank ** 0.5 if config.get("use_rslora") else rank)
    header = _safetensors_header(weights_bytes, weights_path)
    tensors = []
    for key, info in header.items():
        if not key.endswith(".lora_A.weight"):
            if not key.endswith(".lora_B.weight"):
                raise AdapterError(f"{weights_path}: tensor {key!r} is not a LoRA A or B weight")
            continue
        module = key[: -len(".lora_A.weight")]
        b_key = module + ".lora_B.weight"
        name = module.removeprefix(_PREFIX).removeprefix("model.")
        parts = name.split(".")
        if (len(parts) != 4 or parts[0] != "layers" or not parts[1].isdigit() or parts[3] not in targets
                or parts[2] not in ("self_attn", "mlp")):
            raise AdapterError(f"{weights_path}: tensor {key!r} adapts no projection of this model's layers")
        if int(parts[1]) >= num_layers:
            raise AdapterError(f"{weights_path}: tensor {key!r} names layer {parts[1]}; the model has {num_layers}")
        shape = modules[parts[3]]
        b = header.get(b_key)
        if b is None:
            raise AdapterError(f"{weights_path}: {key!r} has no {b_key!r}")
        if info["shape"] != [rank, shape.in_features] or b["shape"] != [shape.out_features, rank]:
            raise AdapterError(f"{weights_path}: {key!r} {info['shape']} / {b['shape']} must be [r={rank}, "
                               f"{shape.in_features}] / [{shape.out_features}, r={rank}]")
        tensors.append(AdapterTensors(name, key, b_key))
    if not tensors:
        raise AdapterError(f"{weights_path}: holds no LoRA weights")
    return PeftAdapter(path, rank, float(scaling), tuple(targets), tuple(tensors),
                       adapter_digest(config_bytes, weights_bytes))
