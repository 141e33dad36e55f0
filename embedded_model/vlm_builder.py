"""Build a tiny vision-language checkpoint offline: the LLaVA architecture (a CLIP vision tower, a projector, the
embedded Llama), seeded random weights, and a processor (a PIL image processor, the embedded tokenizer with an
`<image>` token, a chat template that places it), saved in the Hugging Face folder layout.

It loads as a real one does: `AutoProcessor` and `AutoModelForImageTextToText`. LLaVA keeps one position per token
(the processor expands each `<image>` into `image_tokens` ids), so a decode worker continuing it needs no more
than token ids and positions: the image lives in the KV of those positions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from embedded_model.builder import (CHAT_TEMPLATE, ModelSpec, is_current, publish, start_build, text_config,
                                    train_tokenizer)

VLM_BUILD_VERSION = 1
IMAGE_TOKEN = "<image>"
# The text model's template, a message's content being a string or a list of parts (an image part becomes the
# image token, which the processor expands).
VLM_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{ message['content'] }}",
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + IMAGE_TOKEN + "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}")


@dataclass(frozen=True)
class VlmSpec:
    """Shape of a built vision-language model; the defaults are the embedded one."""

    name: str = "pdserve-tiny-vlm"
    text: ModelSpec = field(default_factory=lambda: ModelSpec(name="pdserve-tiny-vlm"))
    vision_hidden_size: int = 64
    vision_intermediate_size: int = 128
    vision_layers: int = 2
    vision_heads: int = 4
    image_size: int = 32  # every image is resized and cropped to this square
    patch_size: int = 8
    seed: int = 0

    @property
    def image_tokens(self) -> int:
        """Positions one image takes in the prompt (one per patch: the CLIP class token is dropped)."""
        return (self.image_size // self.patch_size) ** 2


def default_vlm_dir() -> Path:
    """Where the embedded VLM lives (PDSERVE_CACHE overrides ~/.cache/pdserve)."""
    root = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))
    return root / "models" / VlmSpec().name


def ensure_default_vlm() -> Path:
    """Return the embedded VLM's folder, building it first if it is missing or stale."""
    out_dir = default_vlm_dir()
    if not is_current(out_dir, VlmSpec(), VLM_BUILD_VERSION):
        build_vlm(out_dir, VlmSpec())
    return out_dir


def build_vlm(out_dir: Path | str, spec: VlmSpec = VlmSpec()) -> Path:
    """Build the checkpoint and processor described by `spec` into `out_dir` and return the folder."""
    import torch
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration
    from transformers import LlavaProcessor

    out_dir = Path(out_dir)
    tmp_dir = start_build(out_dir, spec.name)
    tokenizer = train_tokenizer(spec.text)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    vision = CLIPVisionConfig(hidden_size=spec.vision_hidden_size, intermediate_size=spec.vision_intermediate_size,
                              num_hidden_layers=spec.vision_layers, num_attention_heads=spec.vision_heads,
                              image_size=spec.image_size, patch_size=spec.patch_size,
                              projection_dim=spec.vision_hidden_size)
    config = LlavaConfig(vision_config=vision, text_config=text_config(spec.text, tokenizer),
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), vision_feature_layer=-1,
                         vision_feature_select_strategy="default", image_seq_length=spec.image_tokens,
                         tie_word_embeddings=False, initializer_range=spec.text.initializer_range)
    torch.manual_seed(spec.seed)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    images = CLIPImageProcessorPil(size={"shortest_edge": spec.image_size},
                                   crop_size={"height": spec.image_size, "width": spec.image_size})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=spec.patch_size,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=VLM_CHAT_TEMPLATE)
    model.save_pretrained(tmp_dir, safe_serialization=True)
    processor.save_pretrained(tmp_dir)
    publish(tmp_dir, out_dir, spec, model, VLM_BUILD_VERSION)
    return out_dir
