"""An encode worker's engine on the tiny LLaVA: an image brought by concurrent calls is decoded and encoded once,
its output equal to the prefill worker's own encoder's; one call's bad image or its leaving costs the calls that
share its other images nothing."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kv_events.block_hash import media_content_hash
from tests.helpers import image_bytes
from worker.engine.errors import InvalidRequest
from worker.engine.media import MediaSpan
from worker.torch_engine.encode_engine import EncodeEngine
from worker.torch_engine.vision import VisionEncoder

ROWS = 16  # the tiny LLaVA's positions per image


def span(data: bytes, offset: int = 0, name: str = "image") -> MediaSpan:
    return MediaSpan("image", media_content_hash(data), offset, ROWS, data, name)


@pytest.fixture(scope="module")
def engine(vlm_dir):
    return EncodeEngine(vlm_dir)


def run(engine: EncodeEngine, calls):
    async def main():
        engine.start()
        try:
            return await calls()
        finally:
            engine.shutdown()

    return asyncio.run(main())


def test_concurrent_calls_bringing_one_image_encode_it_once_and_equal_the_models_own_encoder(engine, vlm):
    photo = span(image_bytes((40, 120, 200), (96, 72)))
    misses = engine.vision.cache.misses
    answers = run(engine, lambda: asyncio.gather(*(engine.encode((photo,)) for _ in range(6))))
    assert sorted(found for (outputs, _) in answers for _, found in outputs) == [False] + [True] * 5
    assert engine.vision.cache.misses == misses + 1
    processor, model = vlm
    prefill_side = VisionEncoder(model, processor, torch.device("cpu"), cache_items=0)  # a prefill worker's
    expected = prefill_side.embeddings([photo], prefill_side.prepare([photo]))[photo.content_hash]
    assert torch.allclose(engine.vision.cached(photo.content_hash), expected.to(engine.model.dtype), atol=1e-5)


def test_a_call_with_a_bad_image_fails_alone_and_the_call_sharing_its_good_image_gets_it(engine):
    good = span(image_bytes((200, 40, 40), (64, 48)))
    bad = span(b"\x89PNG\r\n\x1a\n" + b"\0" * 64, ROWS, "messages.0.content.1")

    async def calls():
        return await asyncio.gather(engine.encode((good, bad)), engine.encode((good,)), return_exceptions=True)

    first, second = run(engine, calls)
    assert isinstance(first, InvalidRequest) and "messages.0.content.1" in str(first)
    (shape, _), = second[0]
    assert shape == (ROWS, engine.model.config.get_text_config().hidden_size)


def test_an_image_whose_first_call_left_is_encoded_by_the_call_waiting_on_it(engine):
    shared = span(image_bytes((90, 200, 90), (80, 60)))

    async def calls():
        leaving = asyncio.ensure_future(engine.encode((shared,)))
        await asyncio.sleep(0)  # it registered the image as in flight
        staying = asyncio.ensure_future(engine.encode((shared,)))
        await asyncio.sleep(0)
        leaving.cancel()
        return await staying

    outputs, busy_s = run(engine, calls)
    assert outputs == [((ROWS, engine.model.config.get_text_config().hidden_size), False)]  # encoded by this call
    assert busy_s > 0 and shared.content_hash in engine.vision.cache
