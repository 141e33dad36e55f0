"""Images through encode workers (E -> P -> D) on the tiny LLaVA: every API that takes images gives transformers'
greedy tokens and today's P-encodes answers, streamed and not; an image is encoded once per cluster (the next turn
and another client's request find it cached); a damaged embeddings stream is refused and the request still answers;
an encode worker killed mid-request costs nothing but time."""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import threading

import grpc
import httpx
import pytest

from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc

from tests.helpers import (image_bytes, management_url, metrics_url, scrape, sse_events, start_coordinator,
                           start_worker, vlm_reference, wait_for, write_config)

pytestmark = pytest.mark.system

N = 6
OVERRIDES = {"maxIterTimes": 800, "maxSeqLen": 2048, "maxInputTokenLen": 2048}


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def encode_instances(coordinator) -> list[dict]:
    return httpx.get(f"{management_url(coordinator)}/v1/instances", timeout=10).json().get("encode", [])


def routable_encoders(coordinator, count: int) -> None:
    wait_for(lambda: sum(i["state"] == "healthy" for i in encode_instances(coordinator)) >= count, 60,
             f"{count} encode workers routable")


@pytest.fixture(scope="module")
def epd(vlm_dir, tmp_path_factory):
    """One prefill and one decode worker; coordinator `epd` with two encode workers registered, `pd` without."""
    prefill, decode = start_worker("prefill", vlm_dir), start_worker("decode", vlm_dir)
    folder = tmp_path_factory.mktemp("epd")
    config = write_config(folder / "epd.json", [prefill.address], [decode.address], vlm_dir, **OVERRIDES)
    with_encoders = start_coordinator(config)
    without = start_coordinator(write_config(folder / "pd.json", [prefill.address], [decode.address], vlm_dir,
                                             **OVERRIDES))
    encoders = [start_worker("encode", vlm_dir, "--coordinator", management_url(with_encoders)) for _ in range(2)]
    routable_encoders(with_encoders, 2)
    yield {"epd": with_encoders, "pd": without, "prefill": prefill, "decode": decode, "encoders": encoders,
           "folder": folder}
    for proc in (with_encoders, without, *encoders, prefill, decode):
        proc.stop()


def coordinator_counts(coordinator) -> dict[str, float]:
    figures = scrape(coordinator.address)
    return {outcome: figures.get(("pdserve_encoder_images_total", (("outcome", outcome),)), 0.0)
            for outcome in ("cached", "encoded", "fallback", "pull_failed")}


def encoder_counts(encoders) -> dict[str, float]:
    totals = {"encoded": 0.0, "cached": 0.0, "served": 0.0}
    for encoder in encoders:
        if encoder.proc.poll() is not None:
            continue
        figures = scrape(metrics_url(encoder))
        for outcome in ("encoded", "cached"):
            totals[outcome] += figures[("pdserve_worker_encoded_images_total", (("outcome", outcome),))]
        totals["served"] += figures[("pdserve_worker_embedding_pulls_total", (("outcome", "served"),))]
    return totals


def prefill_encoded(prefill) -> float:
    """Images the prefill worker's own vision tower encoded."""
    return scrape(metrics_url(prefill))[("pdserve_worker_encoder_cache_misses_total", ())]


def grew(before: dict, after: dict) -> dict:
    return {key: after[key] - before[key] for key in after}


def chat_body(content: list[dict], stream: bool = False, max_tokens: int = N) -> dict:
    return {"model": "pdserve-tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": stream}


def chat(address: str, content: list[dict]) -> tuple[list[int], str]:
    reply = httpx.post(f"{address}/v1/chat/completions", json=chat_body(content), timeout=120)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    return choice["token_ids"], choice["message"]["content"]


def streamed_chat_text(address: str, content: list[dict]) -> str:
    reply = httpx.post(f"{address}/v1/chat/completions", json=chat_body(content, stream=True), timeout=120)
    assert reply.status_code == 200, reply.text
    chunks = [json.loads(p) for p in sse_events(reply.content) if p != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def test_chat_with_images_through_an_encode_worker_gives_transformers_tokens_streamed_and_not(epd, vlm):
    red, blue = image_bytes((210, 30, 30)), image_bytes((30, 30, 210), (64, 48))
    content = [image_part(red), {"type": "text", "text": "Compare it with"}, image_part(blue),
               {"type": "text", "text": "please."}]
    _, expected = vlm_reference(vlm, [{"type": "image"}, content[1], {"type": "image"}, content[3]], [red, blue], N)
    before, prefill_before = coordinator_counts(epd["epd"]), prefill_encoded(epd["prefill"])
    tokens, text = chat(epd["epd"].address, content)
    assert tokens == expected
    counted = grew(before, coordinator_counts(epd["epd"]))
    assert counted["encoded"] + counted["cached"] == 2 and counted["fallback"] == counted["pull_failed"] == 0
    assert prefill_encoded(epd["prefill"]) == prefill_before  # pulled, never encoded by the prefill worker
    assert streamed_chat_text(epd["epd"].address, content) == text
    assert chat(epd["pd"].address, content) == (tokens, text)  # today's path: the prefill worker encodes


def test_every_api_that_takes_list_inputs_answers_as_without_encode_workers(epd):
    green = image_bytes((30, 200, 40), (48, 40))
    items = [{"type": "text", "text": "A photo: "}, {"type": "image_url", "image_url": data_url(green)},
             {"type": "text", "text": " It shows"}]
    before = coordinator_counts(epd["epd"])
    answers = {}
    for name, coordinator in (("epd", epd["epd"]), ("pd", epd["pd"])):
        url = coordinator.address
        tgi = httpx.post(f"{url}/generate", timeout=120, json={"inputs": items, "parameters": {
            "max_new_tokens": N, "details": True, "decoder_input_details": False}})
        completion = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "pdserve-tiny", "prompt": items, "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        completion_stream = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "pdserve-tiny", "prompt": items, "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "stream": True})
        vllm = httpx.post(f"{url}/generate", timeout=120, json={"prompt": items, "max_tokens": N, "temperature": 0})
        triton = httpx.post(f"{url}/v2/models/pdserve-tiny/generate", timeout=120, json={
            "text_input": items, "parameters": {"max_new_tokens": N}})
        mindie = httpx.post(f"{url}/infer", timeout=120, json={"inputs": items, "stream": False,
                                                              "parameters": {"max_new_tokens": N}})
        for reply in (tgi, completion, completion_stream, vllm, triton, mindie):
            assert reply.status_code == 200, reply.text
        streamed = "".join(json.loads(p)["choices"][0]["text"] for p in sse_events(completion_stream.content)
                           if p != "[DONE]")
        answers[name] = ([t["id"] for t in tgi.json()["details"]["tokens"]],
                         completion.json()["choices"][0]["token_ids"], streamed, vllm.json()["text"],
                         triton.json()["text_output"], mindie.json()["generated_text"])
    assert answers["epd"] == answers["pd"]
    assert answers["epd"][0] == answers["epd"][1]
    counted = grew(before, coordinator_counts(epd["epd"]))
    assert counted["encoded"] + counted["cached"] == 6 and counted["fallback"] == 0  # every API's image, by an encoder


def test_an_image_in_the_next_turn_and_in_another_clients_request_is_not_encoded_again(epd):
    photo = image_bytes((150, 90, 200), (56, 44))
    first = [image_part(photo), {"type": "text", "text": "What colour dominates?"}]
    tokens, text = chat(epd["epd"].address, first)
    before, prefill_before = encoder_counts(epd["encoders"]), prefill_encoded(epd["prefill"])
    placed = coordinator_counts(epd["epd"])
    turn = {"model": "pdserve-tiny", "max_tokens": N, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "messages": [{"role": "user", "content": first}, {"role": "assistant", "content": text},
                         {"role": "user", "content": [{"type": "text", "text": "And the edges?"}]}]}
    next_turn = httpx.post(f"{epd['epd'].address}/v1/chat/completions", json=turn, timeout=120)
    assert next_turn.status_code == 200, next_turn.text
    other_client = chat(epd["epd"].address, [{"type": "text", "text": "Another client asks:"}, *first])
    # Both times the coordinator found it held by an encode worker (its KV events): no call, no file sent.
    assert grew(placed, coordinator_counts(epd["epd"]))["cached"] == 2
    assert grew(before, encoder_counts(epd["encoders"]))["encoded"] == 0
    assert prefill_encoded(epd["prefill"]) == prefill_before
    reference = httpx.post(f"{epd['pd'].address}/v1/chat/completions", json=turn, timeout=120).json()
    assert next_turn.json()["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
    assert other_client == chat(epd["pd"].address, [{"type": "text", "text": "Another client asks:"}, *first])


class CorruptingProxy:
    """A TCP proxy to an encode worker's plaintext gRPC port that flips one byte in the middle of every large
    HTTP/2 DATA frame the worker sends back: the embeddings chunks, whose framing still parses."""

    def __init__(self, upstream: str):
        self.upstream = upstream.rsplit(":", 1)
        self.loop = asyncio.new_event_loop()
        self.flipped = 0
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        started.set()
        self.loop.run_forever()

    async def _serve(self, client_reader, client_writer) -> None:
        reader, writer = await asyncio.open_connection(self.upstream[0], int(self.upstream[1]))
        await asyncio.gather(self._pipe(client_reader, writer), self._frames(reader, client_writer),
                             return_exceptions=True)
        for w in (writer, client_writer):
            w.close()

    @staticmethod
    async def _pipe(reader, writer) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    async def _frames(self, reader, writer) -> None:
        while True:
            try:
                head = await reader.readexactly(9)
                payload = bytearray(await reader.readexactly(int.from_bytes(head[:3], "big")))
            except asyncio.IncompleteReadError:  # the worker closed the connection
                writer.close()
                return
            if head[3] == 0 and len(payload) >= 4096:  # DATA: the tensor's bytes fill its middle
                payload[len(payload) // 2] ^= 0xFF
                self.flipped += 1
            writer.write(head + payload)
            await writer.drain()

    def close(self) -> None:
        async def stop():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.loop.stop()

        asyncio.run_coroutine_threadsafe(stop(), self.loop)


def test_an_encode_worker_refuses_a_role_switch_naming_why(epd):
    stub = pb_grpc.WorkerControlStub(grpc.insecure_channel(epd["encoders"][0].address))
    with pytest.raises(grpc.RpcError) as refused:
        stub.SwitchRole(pb.SwitchRoleRequest(role="prefill", drain_timeout_s=1), timeout=10)
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "holds no language model" in refused.value.details()


def test_a_damaged_embeddings_stream_is_refused_and_the_request_still_answers(epd, vlm_dir, vlm):
    """An encode worker registered at the proxy's address: its Encode answers pass, its embeddings arrive damaged."""
    proxy = CorruptingProxy(epd["encoders"][0].address)
    config = json.loads((epd["folder"] / "epd.json").read_text())
    config["health_config"] = {"heartbeat_timeout_s": 3600}  # the proxy's registration sends no heartbeats
    (epd["folder"] / "damaged.json").write_text(json.dumps(config))
    coordinator = start_coordinator(epd["folder"] / "damaged.json")
    try:
        registered = httpx.post(f"{management_url(coordinator)}/v1/instances/register", timeout=10,
                                json={"role": "encode", "address": proxy.address})
        assert registered.status_code == 200, registered.text
        routable_encoders(coordinator, 1)
        yellow = image_bytes((230, 220, 20), (44, 52))
        content = [image_part(yellow), {"type": "text", "text": "Is it bright?"}]
        _, expected = vlm_reference(vlm, [{"type": "image"}, content[1]], [yellow], N)
        prefill_figures = scrape(metrics_url(epd["prefill"]))
        assert chat(coordinator.address, content)[0] == expected
        assert proxy.flipped >= 1
        failed = ("pdserve_worker_embedding_pulls_total", (("outcome", "failed"),))
        assert scrape(metrics_url(epd["prefill"]))[failed] == prefill_figures[failed] + 1
        assert coordinator_counts(coordinator)["pull_failed"] == 1  # then the file: encoded by the prefill worker
    finally:
        coordinator.stop()
        proxy.close()


def test_an_encode_worker_killed_mid_request_costs_the_request_nothing_but_time(epd, vlm):
    # Both encode workers are stopped first, so the request's Encode call is caught in flight (the coordinator's
    # view says where), whichever worker it went to; that one is killed, the other resumed.
    coordinator, encoders = epd["epd"], epd["encoders"]
    images = [image_bytes((20 + 60 * i, 90, 160), (40 + 8 * i, 30)) for i in range(3)]
    content = [*(image_part(b) for b in images), {"type": "text", "text": "Which differs?"}]
    before = coordinator_counts(coordinator)
    encoded_before = {e.address: encoder_counts([e])["encoded"] for e in encoders}
    result: dict = {}
    for encoder in encoders:
        encoder.proc.send_signal(signal.SIGSTOP)
    request = threading.Thread(target=lambda: result.update(answer=chat(coordinator.address, content)))
    request.start()
    try:
        busy = wait_for(lambda: [i["address"] for i in encode_instances(coordinator) if i["outstanding_requests"]],
                        60, "the request's Encode call in flight")
        victim = next(e for e in encoders if e.address == busy[0])
        victim.proc.send_signal(signal.SIGKILL)
    finally:
        for encoder in encoders:
            encoder.proc.send_signal(signal.SIGCONT)
    request.join(180)
    _, expected = vlm_reference(vlm, [*({"type": "image"} for _ in images), content[-1]], images, N)
    assert result["answer"][0] == expected
    recovered = grew(before, coordinator_counts(coordinator))
    survivor = next(e for e in encoders if e is not victim)
    # The other encode worker took the images, or the prefill worker got the files.
    by_survivor = encoder_counts([survivor])["encoded"] - encoded_before[survivor.address]
    assert by_survivor == 3 or recovered["fallback"] == 3, (recovered, by_survivor)
    assert recovered["encoded"] + recovered["fallback"] == 3  # the killed worker's answer never came
