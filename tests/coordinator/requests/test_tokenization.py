"""The coordinator's tokenizer and model facts, read without transformers' Auto classes (which import torch): the
same tokenizer, ids, chat template and limits AutoTokenizer and AutoConfig give, and a coordinator process that
never loads torch for a text model."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from transformers import AutoConfig, AutoTokenizer

from coordinator.requests.tokenization import PromptTokenizer, load_tokenizer, read_model_config
from tests.helpers import ServerProcess, pdserve_argv, write_config

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi  there\n\nnew ü"}]
TEXTS = ["Hello world  ü", "  leading spaces and\ttabs", "日本語のテキスト", ""]


@pytest.mark.parametrize("model", ["model_dir", "vlm_dir"])
def test_the_tokenizer_is_autotokenizers_class_with_its_ids_special_ids_and_chat_template(request, model):
    folder: Path = request.getfixturevalue(model)
    ours, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert type(ours) is type(auto)
    assert ours.all_special_ids == auto.all_special_ids and len(ours) == len(auto)
    assert [ours(t)["input_ids"] for t in TEXTS] == [auto(t)["input_ids"] for t in TEXTS]
    template = dict(add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(MESSAGES, **template) == auto.apply_chat_template(MESSAGES, **template)


@pytest.mark.parametrize("model", ["model_dir", "vlm_dir"])
def test_limits_and_vocabulary_are_autoconfigs(request, model):
    folder: Path = request.getfixturevalue(model)
    config = AutoConfig.from_pretrained(folder)
    text = config.get_text_config()
    tokenizer = PromptTokenizer(folder)
    assert tokenizer.max_position_embeddings == text.max_position_embeddings
    assert tokenizer.vocab_size == text.vocab_size
    assert (tokenizer.images is not None) == hasattr(config, "vision_config")


def test_model_config_reads_nested_sections_as_attributes(model_dir):
    config = read_model_config(model_dir)
    auto = AutoConfig.from_pretrained(model_dir)
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers"):
        assert getattr(config, key) == getattr(auto, key), key
    assert not hasattr(config, "vision_config")


@pytest.mark.parametrize("model_type, tokenizer_class", [
    ("llama", "NoSuchTokenizer"),  # a name transformers does not export
    ("qwen2", "TokenizersBackend"),  # AutoTokenizer takes qwen2's own class
    ("mistral", "LlamaTokenizer"),  # AutoTokenizer takes the byte-level file's class, not the named one
])
def test_a_checkpoint_not_known_to_load_its_named_class_goes_through_autotokenizer(model_dir, tmp_path, model_type,
                                                                                 tokenizer_class):
    for item in model_dir.iterdir():
        if item.name not in ("config.json", "tokenizer_config.json"):
            (tmp_path / item.name).symlink_to(item)
    for name, key, value in (("config.json", "model_type", model_type),
                             ("tokenizer_config.json", "tokenizer_class", tokenizer_class)):
        settings = json.loads((model_dir / name).read_text())
        (tmp_path / name).write_text(json.dumps({**settings, key: value}))
    ours, auto = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert type(ours) is type(auto)
    assert [ours(t)["input_ids"] for t in TEXTS] == [auto(t)["input_ids"] for t in TEXTS]


def test_a_text_config_without_its_sizes_takes_autoconfigs_defaults(model_dir, tmp_path):
    for item in model_dir.iterdir():
        if item.name != "config.json":
            (tmp_path / item.name).symlink_to(item)
    settings = json.loads((model_dir / "config.json").read_text())
    del settings["max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(settings))
    expected = AutoConfig.from_pretrained(tmp_path).max_position_embeddings
    assert PromptTokenizer(tmp_path).max_position_embeddings == expected


@pytest.mark.system
def test_a_coordinator_serving_a_text_model_never_loads_torch(cluster, tmp_path):
    config = write_config(tmp_path / "ms_coordinator.json", [cluster.prefill.address], [cluster.decode.address],
                          cluster.model_dir)
    coordinator = ServerProcess(pdserve_argv("coordinator", "--config", str(config)), "pdserve coordinator ready:",
                                fork=False)  # spawned as `pdserve coordinator` is, not forked from the test's server
    try:
        assert httpx.get(f"{coordinator.address}/health", timeout=30).status_code == 200
        maps = Path(f"/proc/{coordinator.proc.pid}/maps").read_text()
        assert "libtorch" not in maps and "libc10" not in maps
    finally:
        coordinator.stop()
