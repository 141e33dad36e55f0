"""A vision-language checkpoint in the paged runner: prompts with images give `generate`'s greedy tokens, however
the prompt is chunked (an image cut between chunks) and whether its leading blocks came from the prefix cache; the
cache's hashes and the encoder cache know images by content."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from embedded_model.vlm_builder import VlmSpec
from kv_events.block_hash import media_content_hash
from worker.engine.block_pool import BlockTable
from worker.engine.errors import InvalidRequest
from worker.engine.media import MediaSpan, cache_token_ids
from worker.torch_engine.build import paged_pool
from worker.engine.scheduler import Chunk
from worker.torch_engine.model_runner import DecodeRow, ModelRunner
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


@dataclass(eq=False)
class Work:
    """A prompt as the engines hand it to the runner (a PromptWork's fields the runner reads)."""

    token_ids: list[int]
    media: tuple[MediaSpan, ...]
    prepared_media: object
    table: BlockTable = field(default_factory=BlockTable)
    lora: None = None
    prompt_logprobs: None = None


def greedy(runner: ModelRunner, prompt: list[int], media, chunk: int = 10_000, cached: bool = False) -> list[int]:
    """Prefill as the engines do (their images prepared, then encoded per chunk by `prompt_chunks`), then decode."""
    pool = runner.block_pool
    work = Work(prompt, media, runner.prepare_media(media))
    keys = cache_token_ids(prompt, media)
    start = pool.cached_prefix(keys, len(prompt) - 1, work.table) if cached else 0
    table = work.table
    assert pool.grow(table, len(prompt) + NUM_NEW)
    while start < len(prompt):
        end = min(len(prompt), start + chunk)
        prompt_chunks, failed = runner.prompt_chunks([Chunk(work, start, end)], lambda c: c.end == len(prompt))
        assert not failed, failed
        logits = runner.forward([], prompt_chunks)
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
    assert greedy(runner, prompt, media) == expected
    assert greedy(runner, prompt, media, chunk=7) == expected  # image rows split across chunks
    assert greedy(runner, prompt, media, cached=True) == expected  # the prefix cache's blocks, then the rest


def test_the_same_text_with_another_image_never_hits_the_prefix_cache_and_the_encoder_cache_skips_a_seen_image(
        runner, vlm):
    parts = [{"type": "image"}, {"type": "text", "text": "Which colour dominates here?"}]
    prompt, _ = vlm_reference(vlm, parts, [RED], 1)
    image_id = runner.model.config.image_token_id
    red, blue = spans_of(prompt, [RED], image_id), spans_of(prompt, [BLUE], image_id)
    assert red and blue
    pool = runner.block_pool
    greedy(runner, prompt, red)
    assert pool.cached_prefix(cache_token_ids(prompt, blue), len(prompt) - 1, BlockTable()) == 0
    table = BlockTable()
    assert pool.cached_prefix(cache_token_ids(prompt, red), len(prompt) - 1, table) > red[0].end
    pool.release(table)
    hits, misses = runner.vision.cache.hits, runner.vision.cache.misses
    assert greedy(runner, prompt, red) == greedy(runner, prompt, red)
    assert runner.vision.cache.hits == hits + 2 and runner.vision.cache.misses == misses  # never encoded again
    assert greedy(runner, prompt, red, chunk=7) == greedy(runner, prompt, red)  # split: the request's own rows


def test_a_corrupt_image_or_a_wrong_placeholder_count_is_refused_naming_its_field(runner):
    with pytest.raises(InvalidRequest, match=r"messages\.0\.content\.1: cannot decode the image"):
        runner.prepare_media((MediaSpan("image", 1, 0, 16, b"not an image at all", "messages.0.content.1"),))
    with pytest.raises(InvalidRequest, match=r"inputs\.2: the model gives this image 16 positions.*holds 9"):
        runner.prepare_media((MediaSpan("image", media_content_hash(RED) + 1, 0, 9, RED, "inputs.2"),))
    gif = image_bytes((1, 2, 3), fmt="GIF")
    with pytest.raises(InvalidRequest, match=r"image type GIF is not one of jpg, png"):
        runner.prepare_media((MediaSpan("image", media_content_hash(gif), 0, 16, gif, "x"),))


def test_a_chunk_whose_image_fails_to_encode_comes_back_apart_and_the_others_go_on(runner):
    good = Work(list(range(3, 40)), (), None)
    # Never prepared (as if the encoder cache had it when checked, and dropped it since), and not an image.
    bad_image = MediaSpan("image", 4242, 0, 16, b"garbage", "inputs.0.image_url")
    bad = Work([1224] * 16 + list(range(3, 10)), (bad_image,), None)
    for work in (good, bad):
        assert runner.block_pool.grow(work.table, len(work.token_ids))
    chunks, failed = runner.prompt_chunks([Chunk(bad, 0, 23), Chunk(good, 0, 37)], lambda c: True)
    assert [c.token_ids for c in chunks] == [good.token_ids]
    assert [(c.work, type(exc)) for c, exc in failed] == [(bad, InvalidRequest)]
    assert runner.forward([], chunks).shape[0] == 1
    for work in (good, bad):
        runner.block_pool.release(work.table)
