"""List inputs: validated by the multimodal rules of the MindIE API (docs/compatibility.md), then refused clearly for a
text-only model."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.system

IMAGE = {"type": "image_url", "image_url": "/data/multimodal_inputs/cat.png"}


@pytest.mark.parametrize("path,field,extra", [
    ("/generate", "inputs", {}),
    ("/infer", "inputs", {}),
    ("/v2/models/pdserve-tiny/generate", "text_input", {}),
    ("/generate", "prompt", {"max_tokens": 3}),
])
def test_text_only_item_list_is_served_as_its_text(http, path, field, extra):
    items = [{"type": "text", "text": "My name is"}, {"type": "text", "text": " Olivier"}]
    assert http.post(path, json={field: items, **extra}).status_code == 200


@pytest.mark.parametrize("items,status,needle", [
    ([{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": "/etc/passwd.png"}], 400,
     "must lie under /data/multimodal_inputs/"),
    ([{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": "http://example.com/x.jpg"}], 400,
     "not listed in ALLOWED_MEDIA_URLS_ENV"),
    ([{"type": "text", "text": "hi"}, {"type": "video_url", "video_url": "/data/multimodal_inputs/a.gif"}], 400,
     "is not one of"),
    ([{"type": "text", "text": "hi"}] + [{"type": "image_url", "image_url": "data:image/jpeg;base64,AAAA"}] * 21,
     400, "at most 20 image/video/audio items"),
    ([{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": "data:image/jpeg;base64,AAAA"}], 400,
     "text-only"),
    ([{"type": "sound", "text": "hi"}], 400, "must be one of text, image_url"),
    ([], 400, "inputs"),
    ([{"type": "image_url", "image_url": "data:image/gif;base64,AAAA"}], 400, "only base64-encoded jpg"),
])
def test_bad_or_media_item_lists_get_clear_4xx(http, items, status, needle):
    resp = http.post("/generate", json={"inputs": items})
    assert resp.status_code == status
    assert needle in resp.json()["error"]


def test_openai_chat_image_part_is_refused_for_a_text_only_model(http):
    resp = http.post("/v1/chat/completions", json={"model": "pdserve-tiny", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AAAA"}}]}]})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert "text-only" in error["message"] and error["param"] == "messages.0.content"


def test_openai_chat_text_parts_are_joined(http):
    resp = http.post("/v1/chat/completions", json={"model": "pdserve-tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]}]})
    assert resp.status_code == 200
