"""Build a tiny Llama-architecture checkpoint in the Hugging Face folder layout.

The tokenizer is a byte-level BPE trained on the shipped corpus and the weights come from a
seeded random init, so the same spec always yields the same files, offline, in seconds.
Workers load the result with AutoModelForCausalLM / AutoTokenizer like any real checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CORPUS_PATH = Path(__file__).with_name("corpus.txt")
# Bump when the build recipe changes so cached copies are rebuilt.
BUILD_VERSION = 2
STAMP_FILE = "pdserve_build.json"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Tools follow the Hermes/Qwen convention: listed in a system block, called as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>, answered by role "tool".
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools. To call one, answer with "
    "<tool_call>{\"name\": <name>, \"arguments\": <object>}</tool_call>.\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "<tool_call>{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": {{ call['function']['arguments'] }}}"
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a built model; the defaults are the embedded default model."""

    name: str = "pdserve-tiny"
    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 344
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    # A wide init makes greedy output vary from token to token, which exposes KV-cache bugs.
    initializer_range: float = 0.3
    seed: int = 0


def default_model_dir() -> Path:
    """Where the embedded default model lives (PDSERVE_CACHE overrides ~/.cache/pdserve)."""
    root = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))
    return root / "models" / ModelSpec().name


def is_current(out_dir: Path, spec, build_version: int = BUILD_VERSION) -> bool:
    """Whether `out_dir` holds a finished build of `spec` by this recipe (its stamp says so)."""
    stamp = out_dir / STAMP_FILE
    if not stamp.exists():
        return False
    try:
        data = json.loads(stamp.read_text())
    except ValueError:
        return False
    return data == {"build_version": build_version, "spec": asdict(spec)}


def start_build(out_dir: Path, name: str) -> Path:
    """The staging folder of a build of `name` into `out_dir` (swapped in by `publish`); transformers quiet."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    logger.info("building model %s into %s", name, out_dir)
    tmp_dir = out_dir.with_name(out_dir.name + ".partial")
    tmp_dir.mkdir(parents=True, exist_ok=True)
    return tmp_dir


def publish(tmp_dir: Path, out_dir: Path, spec, model, build_version: int = BUILD_VERSION) -> None:
    """Stamp a finished build of `model` in `tmp_dir` and swap it in as `out_dir` (a concurrent reader never sees
    half of it)."""
    (tmp_dir / STAMP_FILE).write_text(json.dumps({"build_version": build_version, "spec": asdict(spec)}))
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    tmp_dir.rename(out_dir)
    logger.info("model %s ready: %d parameters", spec.name, sum(p.numel() for p in model.parameters()))


def ensure_default_model() -> Path:
    """Return the default model folder, building it first if it is missing or stale."""
    out_dir = default_model_dir()
    if not is_current(out_dir, ModelSpec()):
        build_model(out_dir, ModelSpec())
    return out_dir


def train_tokenizer(spec: ModelSpec):
    """The byte-level BPE tokenizer of `spec`, trained on the shipped corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = CORPUS_PATH.read_text(encoding="utf-8").splitlines()
    tok.train_from_iterator(lines, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
    )


def text_config(spec: ModelSpec, tokenizer):
    """The Llama config of `spec` over `tokenizer` (the text model of the VLM too)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def build_model(out_dir: Path | str, spec: ModelSpec = ModelSpec()) -> Path:
    """Build the checkpoint described by `spec` into `out_dir` and return the folder."""
    import torch
    from transformers import LlamaForCausalLM

    out_dir = Path(out_dir)
    tmp_dir = start_build(out_dir, spec.name)
    tokenizer = train_tokenizer(spec)
    config = text_config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp_dir, safe_serialization=True)
    tokenizer.save_pretrained(tmp_dir)
    publish(tmp_dir, out_dir, spec, model)
    return out_dir
