"""The LoRA adapters a coordinator serves, by name, and how a request's `model` / `adapter_id` selects one.

Life cycle of a served adapter:
  1. Configured (`model_config.loraModules`, `pdserve up --lora NAME=PATH`) or loaded at run time
     (`POST /v1/load_lora_adapter` on the management port): its folder is checked against the model
     (`adapters.peft_folder.read_adapter`: a 400 naming the file or key) and its identity taken.
  2. Requests name it; each carries a `AdapterRef` (name, folder, identity) to its workers, which load it on
     demand, and salts its prompt's block hashes with the identity for cache-aware routing.
  3. Unloaded (`POST /v1/unload_lora_adapter`): new requests naming it get a 404 at once; requests already
     holding it run to their end (workers drop it from their residency as it ages out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from adapters.peft_folder import AdapterError, AdapterRef, ModuleShape, model_module_shapes, read_adapter
from coordinator.errors import ApiError

# What clients send to mean "no adapter" in the APIs whose adapter field has a default (TGI's "None").
BASE_NAMES = frozenset({"", "None"})


@dataclass
class LoraRegistry:
    """The adapters served beside the model `model_name`, checked against its projections."""

    model_name: str
    module_shapes: dict[str, ModuleShape]  # empty: the model takes no adapters (a vision-language model)
    num_layers: int
    max_rank: int = 16
    adapters: dict[str, AdapterRef] = field(default_factory=dict)

    @classmethod
    def for_model(cls, model_name: str, model_config, max_rank: int) -> LoraRegistry:
        """A registry for a transformers config (adapters only on a text model)."""
        if hasattr(model_config, "vision_config"):
            return cls(model_name, {}, 0, max_rank)
        return cls(model_name, model_module_shapes(model_config), model_config.num_hidden_layers, max_rank)

    def load(self, name: str, path: str) -> AdapterRef:
        """Serve the adapter in `path` as `name`; ValueError naming the problem (the name, the file or the key)."""
        return self.add(self.check(name, path))

    def add(self, adapter: AdapterRef) -> AdapterRef:
        """Serve an adapter `check` made (ValueError when its name was taken since)."""
        self._refuse_taken(adapter.name)
        self.adapters[adapter.name] = adapter
        return adapter

    def _refuse_taken(self, name: str) -> None:
        if name in self.adapters:
            raise ValueError(f"lora_name={name!r}: an adapter of that name is served already; unload it first")

    def check(self, name: str, path: str) -> AdapterRef:
        """The adapter in `path` under `name`, checked against the model, not served yet (it reads both files:
        off the event loop at run time); ValueError naming the problem."""
        if not name or name in BASE_NAMES or name == self.model_name:
            raise ValueError(f"lora_name={name!r}: must be non-empty and not the served model's name")
        self._refuse_taken(name)
        if not self.module_shapes:
            raise ValueError(f"{self.model_name}: LoRA adapters on a vision-language model are not supported yet")
        folder = Path(path)
        if not folder.is_absolute():
            raise ValueError(f"lora_path={path!r}: must be an absolute path (workers resolve it on their host)")
        try:
            adapter = read_adapter(folder, self.module_shapes, self.num_layers, self.max_rank)
        except AdapterError as exc:
            raise ValueError(str(exc)) from None
        return AdapterRef(name, str(folder), adapter.digest)

    def unload(self, name: str) -> AdapterRef:
        """Stop serving `name`; KeyError when it is not served."""
        return self.adapters.pop(name)

    def select(self, requested: str | None, param: str) -> AdapterRef | None:
        """The adapter a request's `param` names (None: the base model, by no name, "None" or the model's name);
        a 404 naming what is served otherwise."""
        if requested is None or requested in BASE_NAMES or requested == self.model_name:
            return None
        adapter = self.adapters.get(requested)
        if adapter is None:
            served = [self.model_name, *self.adapters]
            raise ApiError(404, f"{param}={requested!r}: no such model or LoRA adapter; this server serves "
                                f"{served}", param=param)
        return adapter

    def digest_of(self, name: str) -> int | None:
        """The identity of the adapter served as `name` (None: none is)."""
        adapter = self.adapters.get(name)
        return adapter.digest if adapter is not None else None
