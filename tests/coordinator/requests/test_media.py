"""A request's images from references to placed media: fetched within their bounds, their placeholders expanded
to the model's positions, and truncation that never cuts one (the embedded VLM's processor, no processes)."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest

from coordinator.apis.multimodal import MediaRef, parse_items
from coordinator.errors import ApiError
from coordinator.requests.media import MediaFetcher, image_size, place_media, truncate_with_media
from kv_events.block_hash import media_content_hash
from tests.helpers import image_bytes

RED = image_bytes((220, 20, 20))


class SixteenPerImage:
    """The embedded VLM's counts (16 positions per image), without loading its processor."""

    placeholder = "<image>"
    token_id = 9

    def positions(self, width: int, height: int) -> int:
        return 16


def refs(n: int) -> tuple[MediaRef, ...]:
    return tuple(MediaRef("image_url", "x.png", f"inputs.{i}") for i in range(n))


def test_each_placeholder_becomes_its_images_positions_with_its_content_hash():
    blue = image_bytes((0, 0, 200), fmt="JPEG")
    ids, media = place_media([1, 9, 2, 3, 9, 4], refs(2), [RED, blue], SixteenPerImage(), "inputs")
    assert ids == [1] + [9] * 16 + [2, 3] + [9] * 16 + [4]
    assert [(m.offset, m.num_tokens, m.source) for m in media] == [(1, 16, "inputs.0.image_url"),
                                                                 (19, 16, "inputs.1.image_url")]
    assert media[1].content_hash == media_content_hash(blue) != media[0].content_hash


def test_placeholders_that_do_not_pair_with_the_images_are_a_400():
    with pytest.raises(ApiError, match=r"inputs: the prompt holds 2 image placeholders .* for 1 images"):
        place_media([9, 1, 9], refs(1), [RED], SixteenPerImage(), "inputs")
    with pytest.raises(ApiError, match=r"prompt: the prompt holds 1 image placeholders .* for 0 images"):
        place_media([1, 9], (), [], SixteenPerImage(), "prompt")  # typed into a text prompt
    assert place_media([1, 2], (), [], SixteenPerImage(), "prompt") == ([1, 2], ())


def test_a_file_that_is_not_a_jpg_or_png_is_a_400_naming_its_field():
    with pytest.raises(ApiError, match=r"inputs\.0\.image_url: image type GIF is not one of jpg, png"):
        image_size(image_bytes((1, 2, 3), fmt="GIF"), "inputs.0.image_url")
    with pytest.raises(ApiError, match=r"inputs\.0\.image_url: not a readable jpg or png image"):
        image_size(b"\x89PNG garbage", "inputs.0.image_url")
    assert image_size(RED, "x") == (40, 30)
    from PIL import Image

    with pytest.raises(ApiError, match=r"inputs\.0\.image_url: the image is too large to decode"):
        huge = io.BytesIO()
        Image.new("1", (10_000, 10_000)).save(huge, "PNG")  # 100 M pixels, a few kB: past PIL's bomb bound
        image_size(huge.getvalue(), "inputs.0.image_url")
    with pytest.raises(ApiError, match=r"x: the image is 2000x1; its longer side may be at most 50 times"):
        image_size(image_bytes((0, 0, 0), (2000, 1)), "x")


def test_truncation_keeps_whole_images_shifted_and_refuses_to_cut_one():
    ids, media = place_media([1, 2, 9, 3], refs(1), [RED], SixteenPerImage(), "inputs")
    kept, kept_media = truncate_with_media(ids, media, 17, "inputs")
    assert kept == [9] * 16 + [3] and kept_media[0].offset == 0
    assert truncate_with_media(ids, media, 1, "inputs") == ([3], ())
    with pytest.raises(ApiError, match="would cut inputs.0.image_url in two"):
        truncate_with_media(ids, media, 10, "inputs")


def test_data_urls_and_media_folder_files_are_fetched_and_their_total_is_bounded(tmp_path):
    (tmp_path / "red.png").write_bytes(RED)
    fetcher = MediaFetcher(max_request_bytes=2 * len(RED))
    data_url = "data:image/png;base64," + base64.b64encode(RED).decode()
    both = (MediaRef("image_url", data_url, "inputs.0"), MediaRef("image_url", str(tmp_path / "red.png"), "inputs.1"))
    assert asyncio.run(fetcher.fetch_all(both)) == [RED, RED]
    with pytest.raises(ApiError, match="the request's media add up to") as refused:
        asyncio.run(fetcher.fetch_all(both + both[:1]))
    assert refused.value.status == 413
    with pytest.raises(ApiError, match=r"inputs\.0\.image_url: the data URL's base64 does not decode"):
        asyncio.run(fetcher.fetch(MediaRef("image_url", "data:image/png;base64,@@@", "inputs.0")))


def test_a_vision_model_takes_image_items_in_place_and_refuses_video_and_audio_by_name(tmp_path):
    (tmp_path / "a.png").write_bytes(RED)
    (tmp_path / "a.mp4").write_bytes(b"\0")
    items = [{"type": "text", "text": "See "}, {"type": "image_url", "image_url": str(tmp_path / "a.png")}]
    prompt = parse_items(items, "inputs", tmp_path, "<image>")
    assert prompt.text == "See <image>" and prompt.parts[1] == {"type": "image"} and len(prompt.media) == 1
    with pytest.raises(ApiError, match=r"inputs\.1\.video_url: the served model takes images only, not video"):
        parse_items([items[0], {"type": "video_url", "video_url": str(tmp_path / "a.mp4")}], "inputs", tmp_path,
                    "<image>")
    with pytest.raises(ApiError, match="text-only"):
        parse_items(items, "inputs", tmp_path, None)
    with pytest.raises(ApiError, match="at least one text item"):
        parse_items(items[1:], "inputs", tmp_path, "<image>")
    assert parse_items(items[1:], "messages.0.content", tmp_path, "<image>", require_text=False).text == "<image>"
