"""The embedded vision-language model: built offline, loaded as a real checkpoint is (AutoProcessor,
AutoModelForImageTextToText), and its images really change what it computes."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from embedded_model.builder import STAMP_FILE
from embedded_model.vlm_builder import IMAGE_TOKEN, VlmSpec, build_vlm

pytestmark = pytest.mark.system  # builds and loads a checkpoint (seconds)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_vlm(tmp_path_factory.mktemp("vlm") / "pdserve-tiny-vlm")


@pytest.fixture(scope="module")
def loaded(vlm_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return AutoProcessor.from_pretrained(vlm_dir, backend="pil"), AutoModelForImageTextToText.from_pretrained(vlm_dir)


def ask(processor, images: list[Image.Image], text: str = "What is in the picture?"):
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    prompt = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    return processor(images=images or None, text=prompt, return_tensors="pt")


def test_it_loads_through_the_auto_classes_and_each_image_takes_its_patches_positions(loaded):
    processor, model = loaded
    assert type(processor).__name__ == "LlavaProcessor" and type(model).__name__ == "LlavaForConditionalGeneration"
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert model.config.image_token_index == image_id
    for count in (1, 2):
        inputs = ask(processor, [Image.new("RGB", (50, 40), (200, 30, 90))] * count)
        assert (inputs["input_ids"] == image_id).sum().item() == count * VlmSpec().image_tokens == count * 16
        assert inputs["pixel_values"].shape == (count, 3, 32, 32)


def test_text_only_chats_take_string_content_as_the_text_model_does(loaded):
    processor, _ = loaded
    prompt = processor.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


def test_greedy_generation_is_deterministic_and_depends_on_the_image(loaded):
    processor, model = loaded
    red, blue = Image.new("RGB", (64, 64), (220, 20, 20)), Image.new("RGB", (64, 64), (20, 20, 220))

    def greedy(image):
        inputs = ask(processor, [image])
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
        return out[0, inputs["input_ids"].shape[1]:].tolist()

    assert greedy(red) == greedy(red)
    with torch.no_grad():
        logits = [model(**ask(processor, [image])).logits[0, -1] for image in (red, blue)]
    assert not torch.allclose(logits[0], logits[1])  # the vision tower's output reaches the language model


def test_the_build_is_stamped_and_repeatable(vlm_dir, tmp_path):
    again = build_vlm(tmp_path / "again")
    assert (vlm_dir / STAMP_FILE).read_text() == (again / STAMP_FILE).read_text()
    assert (vlm_dir / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
