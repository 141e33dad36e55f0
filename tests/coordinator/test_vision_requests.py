"""A vision-language model served end to end through PD: images from every API that takes media give the tokens
transformers' own `generate` gives, through a prefill worker, through local prefill and across a migration; URLs are
fetched only when listed; bad media are clear 400s naming their field; a repeated image hits both caches."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest

from tests.helpers import (BackgroundStream, health, image_bytes, index_matches_workers, management_url,
                           metrics_url, scrape, serving_decode, sse_events, start_coordinator, start_worker,
                           vlm_reference, wait_for, write_config)

pytestmark = pytest.mark.system

N = 8
RED, BLUE = image_bytes((220, 20, 20)), image_bytes((20, 20, 220), (64, 48), "JPEG")
DATA_URL = "data:image/png;base64," + base64.b64encode(RED).decode()


class MediaServer(BaseHTTPRequestHandler):
    """Serves /red.png, and /stall (answers nothing for a minute)."""

    def do_GET(self):
        if self.path == "/stall":
            time.sleep(60)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(RED)))
        self.end_headers()
        self.wfile.write(RED)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "red.png").write_bytes(RED)
    (folder / "blue.jpg").write_bytes(BLUE)
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    return folder


@pytest.fixture(scope="module")
def media_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), MediaServer)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture(scope="module")
def vlm_cluster(vlm_dir, media_dir, media_server, tmp_path_factory):
    """One prefill and two decode VLM workers; a coordinator that disaggregates, one that prefills locally, one
    that routes on the workers' KV events (cache_affinity)."""
    prefill = start_worker("prefill", vlm_dir)
    decodes = [start_worker("decode", vlm_dir), start_worker("decode", vlm_dir)]
    env = {"ALLOWED_MEDIA_URLS_ENV": f"{media_server}/red.png,{media_server}/stall"}
    overrides = {"multimodalInputsDir": str(media_dir), "mediaFetchTimeout": 1, "maxIterTimes": 800,
                 "maxSeqLen": 2048}
    folder = tmp_path_factory.mktemp("vlm")
    addresses = [d.address for d in decodes]
    pd = start_coordinator(write_config(folder / "pd.json", [prefill.address], addresses, vlm_dir, **overrides), env)
    local = start_coordinator(write_config(
        folder / "local.json", [prefill.address], addresses, vlm_dir,
        sections={"digs_scheduler_config": {"local_prefill_max_tokens": 4096}}, **overrides), env)
    affinity = start_coordinator(write_config(
        folder / "affinity.json", [prefill.address], addresses, vlm_dir,
        sections={"digs_scheduler_config": {"algorithm_type": "cache_affinity"}}, **overrides), env)
    yield {"pd": pd, "local": local, "affinity": affinity, "prefill": prefill,
           "decodes": {d.address: d for d in decodes}}
    for proc in (pd, local, affinity, prefill, *decodes):
        proc.stop()


def chat(address: str, content: list[dict], max_tokens: int = N) -> list[int]:
    client = openai.OpenAI(base_url=f"{address}/v1", api_key="none")
    reply = client.chat.completions.create(model="pdserve-tiny", messages=[{"role": "user", "content": content}],
                                           max_tokens=max_tokens, temperature=0,
                                           extra_body={"return_token_ids": True, "ignore_eos": True})
    return reply.choices[0].model_extra["token_ids"]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


CHATS = {
    "one image": ([image_part("red.png"), {"type": "text", "text": "What is in the picture?"}], [RED]),
    "two images": ([image_part(DATA_URL), image_part("blue.jpg"), {"type": "text", "text": "Compare them."}],
                   [RED, BLUE]),
    "an image after text": ([{"type": "text", "text": "Look at this: "}, image_part("blue.jpg"),
                             {"type": "text", "text": " and describe it."}], [BLUE]),
}


def in_folder(content: list[dict], media_dir) -> list[dict]:
    """Relative media paths made absolute under the media folder."""
    out = []
    for part in content:
        kind = part["type"]
        url = part.get(kind, {}).get("url", "") if kind != "text" else ""
        relative = url and "/" not in url and ":" not in url
        out.append({"type": kind, kind: {"url": str(media_dir / url)}} if relative else part)
    return out


def template_parts(content: list[dict]) -> list[dict]:
    return [{"type": "image"} if p["type"] == "image_url" else p for p in content]


@pytest.mark.parametrize("route", ["pd", "local"])
@pytest.mark.parametrize("case", CHATS)
def test_openai_chat_with_images_gives_generates_greedy_tokens(vlm_cluster, vlm, media_dir, case, route):
    content, images = CHATS[case]
    _, expected = vlm_reference(vlm, template_parts(content), images, N)
    assert chat(vlm_cluster[route].address, in_folder(content, media_dir)) == expected


@pytest.mark.parametrize("route", ["pd", "local"])
def test_list_inputs_of_every_api_that_takes_them_take_an_image_after_text(vlm_cluster, vlm, media_dir, route):
    items = [{"type": "text", "text": "A photo: "}, {"type": "image_url", "image_url": str(media_dir / "red.png")},
             {"type": "text", "text": " It shows"}]
    _, expected = vlm_reference(vlm, "A photo: <image> It shows", [RED], N)
    url = vlm_cluster[route].address
    tgi = httpx.post(f"{url}/generate", timeout=60, json={
        "inputs": items, "parameters": {"max_new_tokens": N, "details": True, "decoder_input_details": False}})
    assert tgi.status_code == 200, tgi.text
    assert [t["id"] for t in tgi.json()["details"]["tokens"]] == expected
    text = tgi.json()["generated_text"]
    if route == "local":
        return  # the other APIs share everything after the prompt with TGI's
    completion = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "pdserve-tiny", "prompt": items, "max_tokens": N, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["token_ids"] == expected
    vllm = httpx.post(f"{url}/generate", timeout=60, json={"prompt": items, "max_tokens": N, "temperature": 0})
    assert vllm.status_code == 200 and vllm.json()["text"] == ["A photo: <image> It shows" + text]
    triton = httpx.post(f"{url}/v2/models/pdserve-tiny/generate", timeout=60, json={
        "text_input": items, "parameters": {"max_new_tokens": N}})
    assert triton.status_code == 200 and triton.json()["text_output"] == text
    mindie = httpx.post(f"{url}/infer", timeout=60, json={"inputs": items, "stream": False,
                                                          "parameters": {"max_new_tokens": N}})
    assert mindie.status_code == 200 and mindie.json()["generated_text"] == text


def test_a_listed_url_is_fetched_and_an_unlisted_or_stalled_one_is_a_400(vlm_cluster, vlm, media_server):
    _, expected = vlm_reference(vlm, template_parts(CHATS["one image"][0]), [RED], N)
    listed = [image_part(f"{media_server}/red.png"), {"type": "text", "text": "What is in the picture?"}]
    assert chat(vlm_cluster["pd"].address, listed) == expected
    with pytest.raises(openai.BadRequestError, match="is not listed in ALLOWED_MEDIA_URLS_ENV"):
        chat(vlm_cluster["pd"].address, [image_part(f"{media_server}/other.png")])
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError, match=r"messages\.0\.content\.0\.image_url: fetching .* took longer"):
        chat(vlm_cluster["pd"].address, [image_part(f"{media_server}/stall")])
    assert time.monotonic() - started < 10


BAD = [
    ([image_part("broken.png")], r"messages\.0\.content\.0\.image_url: not a readable jpg or png image"),
    ([{"type": "video_url", "video_url": {"url": "clip.mp4"}}], r"takes images only, not video"),
    ([image_part("/etc/passwd.png")], r"local files must lie under"),
    ([{"type": "text", "text": "<image> sneaks in"}, image_part("red.png")], r"holds 2 image placeholders"),
    # 20 images are 320 positions: with this text the prompt passes the cluster's 512, though its text alone does not
    ([{"type": "text", "text": "one two three " * 25}] + [image_part("red.png")] * 20,
     r"messages has 5\d\d tokens; the limit is"),
]


@pytest.mark.parametrize("content,message", BAD)
def test_bad_media_are_a_400_naming_the_item_and_the_server_keeps_serving(vlm_cluster, media_dir, content, message):
    address = vlm_cluster["pd"].address
    if content[0]["type"] == "video_url":
        (media_dir / "clip.mp4").write_bytes(b"\0" * 16)
    with pytest.raises(openai.BadRequestError, match=message):
        chat(address, in_folder(content, media_dir))
    assert len(chat(address, in_folder(CHATS["one image"][0], media_dir), 2)) == 2


def test_a_repeated_image_hits_the_prefix_cache_and_after_other_text_the_encoder_cache(vlm_cluster, media_dir):
    address, prefill = vlm_cluster["pd"].address, vlm_cluster["prefill"]
    green = "data:image/png;base64," + base64.b64encode(image_bytes((20, 200, 20))).decode()
    question = {"type": "text", "text": "Describe every detail of this picture, please."}

    def counters() -> tuple[int, float, float]:
        figures = scrape(metrics_url(prefill))
        return (health(prefill.address, "prefill").prefix_hit_tokens,
                figures[("pdserve_worker_encoder_cache_hits_total", ())],
                figures[("pdserve_worker_encoder_cache_misses_total", ())])

    chat(address, [image_part(str(media_dir / "blue.jpg")), question])
    hits, _, _ = counters()
    chat(address, [image_part(str(media_dir / "blue.jpg")), question])
    assert counters()[0] - hits >= 32  # both blocks that hold the image: found, not computed
    hits, encoded, missed = counters()
    chat(address, [image_part(green), question])  # the same text with another image: no block of it hits
    assert counters()[0] - hits < 16 and counters()[2] == missed + 1
    hits = counters()[0]
    chat(address, [{"type": "text", "text": "Before anything else: "}, image_part(green), question])
    assert counters()[0] - hits < 16  # other text first: its blocks differ, the image is computed again...
    assert counters()[1] == encoded + 1 and counters()[2] == missed + 1  # ...from the encoder cache


def decodes_idle(coordinator) -> bool:
    """The coordinator's view: no decode instance has work outstanding or reported running or waiting."""
    listed = httpx.get(f"{management_url(coordinator)}/v1/instances", timeout=10).json()["decode"]
    return all(not i["outstanding_requests"] and not i["reported"]["num_running"] and not i["reported"]["num_waiting"]
               for i in listed)


def test_with_cache_affinity_a_repeated_image_goes_to_the_decode_worker_holding_it_and_another_image_does_not(
        vlm_cluster, media_dir):
    coordinator, decodes = vlm_cluster["affinity"], list(vlm_cluster["decodes"].values())
    question = {"type": "text", "text": "Which shapes and colours can you see in this one?"}
    purple, orange = (image_part("data:image/png;base64," + base64.b64encode(image_bytes(c)).decode())
                      for c in ((120, 20, 160), (250, 140, 10)))

    def decode_figures(name: str) -> dict[str, float]:
        figures = scrape(coordinator.address)
        return {d.address: figures.get((name, (("address", d.address), ("role", "decode"))), 0.0) for d in decodes}

    def grew(name: str, before: dict[str, float]) -> dict[str, float]:
        after = decode_figures(name)
        return {address: after[address] - before[address] for address in after}

    routed = decode_figures("pdserve_instance_routed_prompt_tokens_total")
    chat(coordinator.address, [purple, question])
    holder = max(grew("pdserve_instance_routed_prompt_tokens_total", routed).items(), key=lambda kv: kv[1])[0]
    wait_for(lambda: index_matches_workers(coordinator, decodes), 10, "the index to hold the decode workers' blocks")
    # The router weighs held blocks against load: on a loaded machine the holder's last health report could still
    # show the first chat running, so the repeat waits until the coordinator sees both decode workers idle.
    wait_for(lambda: decodes_idle(coordinator), 60, "both decode workers reported idle")
    expected = decode_figures("pdserve_instance_expected_cached_tokens_total")
    chat(coordinator.address, [purple, question])
    assert grew("pdserve_instance_expected_cached_tokens_total", expected)[holder] >= 32  # the image's blocks
    expected = decode_figures("pdserve_instance_expected_cached_tokens_total")
    chat(coordinator.address, [orange, question])  # the same text, another image: nothing from the image on
    assert all(tokens < 16 for tokens in grew("pdserve_instance_expected_cached_tokens_total", expected).values())


def test_image_requests_preempted_on_a_decode_worker_whose_pool_runs_dry_move_to_another_with_the_same_tokens(
        vlm_cluster, vlm, vlm_dir, tmp_path):
    # 8 blocks of KV: four of these requests (~30 prompt positions, 90 new tokens each) fit at admission but not as
    # they grow; one preempted cannot be recomputed there (its image stayed with the prefill worker).
    small = start_worker("decode", vlm_dir, "--kv-budget-tokens", "128")
    spare = start_worker("decode", vlm_dir)
    coordinator = start_coordinator(write_config(tmp_path / "ms_coordinator.json", [vlm_cluster["prefill"].address],
                                                 [small.address, spare.address], vlm_dir, maxIterTimes=100))
    colours = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30), (200, 30, 200), (30, 200, 200),
               (120, 120, 120), (250, 250, 250)]
    asks = [[image_part("data:image/png;base64," + base64.b64encode(image_bytes(c)).decode()),
             {"type": "text", "text": f"Hi {i}"}] for i, c in enumerate(colours)]
    try:
        with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:  # round robin: half of them on `small`
            got = list(pool.map(lambda content: chat(coordinator.address, content, 90), asks))
        for content, colour, tokens in zip(asks, colours, got):
            assert tokens == vlm_reference(vlm, template_parts(content), [image_bytes(colour)], 90)[1]
        assert scrape(coordinator.address)[("pdserve_request_migrations_total", ())] >= 1
        assert health(small.address, "decode").num_preemptions >= 1
    finally:
        for proc in (coordinator, small, spare):
            proc.stop()


def test_a_stream_with_an_image_whose_decode_worker_dies_continues_elsewhere_with_the_same_tokens(
        vlm_cluster, vlm, media_dir):
    content, images = CHATS["one image"]
    total = 800  # long enough to still be streaming when the kill lands
    _, expected = vlm_reference(vlm, template_parts(content), images, total)
    body = {"model": "pdserve-tiny", "messages": [{"role": "user", "content": in_folder(content, media_dir)}],
            "max_tokens": total, "stream": True, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    coordinator = vlm_cluster["pd"]
    reader = BackgroundStream(f"{coordinator.address}/v1/chat/completions", body)
    assert reader.first_chunk.wait(30)
    victim = serving_decode(coordinator)
    vlm_cluster["decodes"][victim].proc.send_signal(signal.SIGKILL)
    reader.join(60)
    chunks = [json.loads(p) for p in sse_events(reader.raw)[:-1]]
    assert not any("error" in c for c in chunks), chunks[-3:]
    streamed = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids", [])]
    assert streamed == expected
    assert scrape(coordinator.address)[("pdserve_request_migrations_total", ())] == 1
