"""A PEFT folder is checked against the model before any tensor is read: what it is not is named (file or key)."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoConfig

from adapters.peft_folder import AdapterError, adapter_digest, model_module_shapes, read_adapter


@pytest.fixture(scope="module")
def shapes(model_dir):
    config = AutoConfig.from_pretrained(model_dir)
    return model_module_shapes(config), config.num_hidden_layers


def copy(src, tmp_path, **config_changes):
    dst = tmp_path / "adapter"
    shutil.copytree(src, dst)
    if config_changes:
        path = dst / "adapter_config.json"
        config = json.loads(path.read_text())
        config.update(config_changes)
        path.write_text(json.dumps(config))
    return dst


def test_a_peft_folder_reads_with_its_rank_scale_and_every_projection(lora_adapters, shapes):
    adapter = read_adapter(lora_adapters["a1"], *shapes, max_rank=16)
    assert adapter.rank == 8 and adapter.scaling == 2.0
    assert len(adapter.tensors) == 7 * shapes[1]


def test_the_identity_changes_with_either_file(lora_adapters, tmp_path, shapes):
    first = read_adapter(lora_adapters["a1"], *shapes, max_rank=16).digest
    assert read_adapter(copy(lora_adapters["a1"], tmp_path), *shapes, max_rank=16).digest == first
    assert read_adapter(lora_adapters["a2"], *shapes, max_rank=16).digest != first
    assert adapter_digest(b"{}", b"x") != adapter_digest(b"{}x", b"")


@pytest.mark.parametrize("changes,needle", [
    ({"peft_type": "IA3"}, "peft_type must be \"LORA\""),
    ({"r": 64}, "r=64 must be an integer in [1, 16]"),
    ({"target_modules": ["q_proj", "lm_head"]}, "target_modules ['lm_head'] are not modules of this model"),
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
])
def test_a_config_the_engine_cannot_honour_is_refused_naming_the_key(lora_adapters, tmp_path, shapes, changes,
                                                                     needle):
    with pytest.raises(AdapterError, match="adapter_config.json") as info:
        read_adapter(copy(lora_adapters["a1"], tmp_path, **changes), *shapes, max_rank=16)
    assert needle in str(info.value)


def test_a_rank_above_the_limit_and_missing_or_foreign_files_are_refused(lora_adapters, tmp_path, shapes):
    with pytest.raises(AdapterError, match=r"r=8 must be an integer in \[1, 4\]"):
        read_adapter(lora_adapters["a1"], *shapes, max_rank=4)
    folder = copy(lora_adapters["a1"], tmp_path)
    (folder / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(AdapterError, match="adapter_model.safetensors: not a safetensors file"):
        read_adapter(folder, *shapes, max_rank=16)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="adapter_model.safetensors: missing"):
        read_adapter(folder, *shapes, max_rank=16)


def test_weights_for_another_model_are_refused_naming_the_tensor(lora_adapters, tmp_path, shapes):
    modules, layers = shapes
    with pytest.raises(AdapterError, match="names layer 1; the model has 1"):
        read_adapter(lora_adapters["a1"], modules, 1, max_rank=16)
    wider = {name: type(shape)(shape.in_features * 2, shape.out_features) for name, shape in modules.items()}
    with pytest.raises(AdapterError, match=r"lora_A.weight.*must be \[r=8"):
        read_adapter(lora_adapters["a1"], wider, layers, max_rank=16)
