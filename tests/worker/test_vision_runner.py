"""A vision-language checkpoint in the paged runner: prompts with images give `generate`'s greedy tokens, however
the prompt is chunked (an image cut between chunks) and whether its leading blocks came from the prefix cache; the
cache's hashes and the encoder cache know images by content."""

from __future__ import annotations

import pytest

from embedded_model.vlm_builder import VlmSpec
from kv_events.block_hash import media_content_hash
from worker.engine.block_pool import BlockTable
from worker.engine.errors import InvalidRequest
from worker.engine.media import MediaSpan, cache_token_ids
from worker.torch_engine.build import paged_pool
from worker.torch_engine.model_runner import DecodeRow, ModelRunner, PromptChunk
from tests.helpers import image_bytes, vlm_reference

pytestmark = pytest.mark.system  # loads the embedded VLM twice (seconds)

NUM_NEW = 8
IMAGE_TOKENS = VlmSpec().image_tokens
RED, BLUE = image_bytes((220, 20, 20)), image_bytes((20, 20, 220), (64, 48), "JPEG")


@pytest.fixture(scope="module")
def runner(vlm_dir) -> ModelRunner:
    runner = ModelRunner(vlm_dir, device="cpu")
    paged_pool(runner, 4096, 16)
    return runner


def spans_of(prompt: list[int], images: list[bytes], image_id: int) -> tuple[MediaSpan, ...]:
    """The prompt's image spans, as the coordinator lays them out: each image's placeholders in order."""
    starts = [i for i, t in enumerate(prompt) if t == image_id][::IMAGE_TOKENS]
    return tuple(MediaSpan("image", media_content_hash(data), start, IMAGE_TOKENS, data, f"image {i}")
                 for i, (start, data) in enumerate(zip(starts, images)))


def greedy(runner: ModelRunner, prompt: list[int], media, chunk: int = 10_000, cached: bool = False) -> list[int]:
    pool, table = runner.block_pool, BlockTable()
    keys = cache_token_ids(prompt, media)
    start = pool.cached_prefix(keys, len(prompt) - 1, table) if cached else 0
    assert pool.grow(table, len(prompt) + NUM_NEW)
    while start < len(prompt):
        end = min(len(prompt), start + chunk)
        logits = runner.forward([], [PromptChunk(prompt[start:end], start, table, end == len(prompt), media)])
        pool.register(table, keys, end)
        start = end
    out = [int(logits[-1].argmax())]
    while len(out) < NUM_NEW:
        out.append(int(runner.forward([DecodeRow(out[-1], len(prompt) + len(out) - 1, table)], [])[0].argmax()))
    pool.release(table)
    return out


CASES = {
    "one image": ([{"type": "image"}, {"type": "text", "text": "What is in the picture?"}], [RED]),
    "two images": ([{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare them."}], [RED, BLUE]),
    "an image after text": ([{"type": "text", "text": "Look at this: "}, {"type": "image"},
                             {"type": "text", "text": " and describe it."}], [BLUE]),
}


@pytest.mark.parametrize("case", CASES)
def test_prompts_with_images_give_generates_greedy_tokens_whole_chunked_and_from_the_prefix_cache(runner, vlm, case):
    parts, images = CASES[case]
    prompt, expected = vlm_reference(vlm, parts, images, NUM_NEW)
    media = spans_of(prompt, images, runner.model.config.image_token_id)
    runner.check_media(media)
    assert greedy(runner, prompt, media) == expected
    assert greedy(runner, prompt, media, chunk=7) == expected  # image rows split across chunks
    assert greedy(runner, prompt, media, cached=True) == expected  # the prefix cache's blocks, then the rest


def test_the_same_text_with_another_image_never_hits_the_prefix_cache_and_the_encoder_cache_skips_a_seen_image(
        runner, vlm):
    parts = [{"type": "image"}, {"type": "text", "text": "Which colour dominates here?"}]
    prompt, _ = vlm_reference(vlm, parts, [RED], 1)
    red, blue = spans_of(prompt, [RED], runner.model.config.image_token_id), spans_of(prompt, [BLUE], 1224)
    pool = runner.block_pool
    greedy(runner, prompt, red)
    assert pool.cached_prefix(cache_token_ids(prompt, blue), len(prompt) - 1, BlockTable()) == 0
    table = BlockTable()
    assert pool.cached_prefix(cache_token_ids(prompt, red), len(prompt) - 1, table) > red[0].end
    pool.release(table)
    hits = runner.vision.cache.hits
    assert greedy(runner, prompt, red) == greedy(runner, prompt, red)
    assert runner.vision.cache.hits >= hits + 2


def test_a_corrupt_image_or_a_wrong_placeholder_count_is_refused_naming_its_field(runner):
    with pytest.raises(InvalidRequest, match=r"messages\.0\.content\.1: cannot decode the image"):
        runner.check_media((MediaSpan("image", 1, 0, 16, b"not an image at all", "messages.0.content.1"),))
    with pytest.raises(InvalidRequest, match=r"inputs\.2: the model gives this image 16 positions.*holds 9"):
        runner.check_media((MediaSpan("image", media_content_hash(RED) + 1, 0, 9, RED, "inputs.2"),))
    gif = image_bytes((1, 2, 3), fmt="GIF")
    with pytest.raises(InvalidRequest, match=r"image type GIF is not one of jpg, png"):
        runner.check_media((MediaSpan("image", media_content_hash(gif), 0, 16, gif, "x"),))
