"""TGI: /generate, /generate_stream and POST / (huggingface_hub.InferenceClient), field by field."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import InferenceClient

from tests.helpers import sse_events

pytestmark = pytest.mark.system


def tgi(http, path: str, inputs: str = "Hello there", **params):
    return http.post(path, json={"inputs": inputs, "parameters": params})


def test_generate_with_details_and_prefill_matches_the_seed_shape(http, hf_model):
    _, tokenizer = hf_model
    resp = tgi(http, "/generate", max_new_tokens=5, details=True, decoder_input_details=True, seed=42,
               do_sample=False)
    assert resp.status_code == 200
    body = resp.json()
    assert set(body) == {"generated_text", "details"}
    details = body["details"]
    assert set(details) == {"finish_reason", "generated_tokens", "prefill", "prompt_tokens", "seed", "tokens"}
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 5 and details["seed"] == 42
    prompt_ids = tokenizer("Hello there")["input_ids"]
    assert [t["id"] for t in details["prefill"]] == prompt_ids and details["prompt_tokens"] == len(prompt_ids)
    assert len(details["tokens"]) == 5
    for token in details["tokens"]:
        assert set(token) == {"id", "text", "logprob", "special"} and token["logprob"] <= 0
    assert body["generated_text"] == tokenizer.decode([t["id"] for t in details["tokens"]])


def test_generate_without_details_returns_only_the_text(http):
    body = tgi(http, "/generate", max_new_tokens=3).json()
    assert list(body) == ["generated_text"]


def test_return_full_text_prepends_the_inputs(http):
    plain = tgi(http, "/generate", max_new_tokens=3, do_sample=False).json()["generated_text"]
    full = tgi(http, "/generate", max_new_tokens=3, do_sample=False, return_full_text=True).json()["generated_text"]
    assert full == "Hello there" + plain


def test_truncate_keeps_the_last_tokens_of_the_inputs(http, hf_model):
    _, tokenizer = hf_model
    text = "The coordinator sends the prompt to the worker"
    body = tgi(http, "/generate", text, max_new_tokens=2, truncate=3, decoder_input_details=True).json()
    assert [t["id"] for t in body["details"]["prefill"]] == tokenizer(text)["input_ids"][-3:]


def test_generate_stream_events_carry_list_ids_and_the_last_has_details(http):
    with http.stream("POST", "/generate_stream", json={"inputs": "Hello", "parameters": {
            "max_new_tokens": 4, "details": True, "do_sample": False}}) as r:
        assert r.status_code == 200
        events = [json.loads(p) for p in sse_events(r.read())]
    assert len(events) == 4
    for event in events[:-1]:
        assert event["generated_text"] is None and event["details"] is None
        assert isinstance(event["token"]["id"], list) and len(event["token"]["id"]) == 1
    last = events[-1]
    assert last["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert last["details"]["finish_reason"] == "length" and last["details"]["generated_tokens"] == 4
    assert set(last["details"]) == {"prompt_tokens", "finish_reason", "generated_tokens", "seed"}


def test_seeded_sampling_reports_and_reuses_the_seed(http):
    a = tgi(http, "/generate", max_new_tokens=6, do_sample=True, temperature=1.2, seed=7, details=True).json()
    b = tgi(http, "/generate", max_new_tokens=6, do_sample=True, temperature=1.2, seed=7, details=True).json()
    assert a["generated_text"] == b["generated_text"] and a["details"]["seed"] == 7


@pytest.mark.parametrize("params,needle", [
    ({"top_p": 1.0}, "parameters.top_p: must be in (1e-6, 1.0)"),
    ({"temperature": 0}, "parameters.temperature: must be > 1e-6"),
    ({"top_k": 0}, "parameters.top_k"),
    ({"max_new_tokens": 0}, "parameters.max_new_tokens"),
    ({"repetition_penalty": 0}, "parameters.repetition_penalty: must be > 0.0"),
    ({"truncate": 0}, "parameters.truncate"),
    ({"typical_p": 0}, "parameters.typical_p: must be in (0.0, 1.0]"),
    ({"typical_p": 1.5}, "parameters.typical_p: must be in (0.0, 1.0]"),
    ({"watermark": True}, "watermark is not supported"),
    ({"adapter_id": "my lora"}, "parameters.adapter_id"),
    ({"adapter_id": "a" * 257}, "parameters.adapter_id"),
    ({"stop": ["x" * 1025]}, "1 to 1024 characters"),
    ({"seed": 0}, "parameters.seed"),
    ({"bogus": 1}, "parameters.bogus: unknown field"),
])
def test_out_of_range_tgi_parameter_is_400_in_tgi_error_format(http, params, needle):
    resp = tgi(http, "/generate", **params)
    assert resp.status_code == 400
    body = resp.json()
    assert set(body) == {"error", "error_type"} and needle in body["error"]


def test_unknown_adapter_id_is_404_in_tgi_error_format_naming_what_is_served(http):
    resp = tgi(http, "/generate", adapter_id="my-lora")
    assert resp.status_code == 404
    body = resp.json()
    assert set(body) == {"error", "error_type"} and "parameters.adapter_id='my-lora'" in body["error"]


def test_typical_p_and_watermark_at_their_defaults_are_accepted(http):
    assert tgi(http, "/generate", max_new_tokens=2, typical_p=1.0, watermark=False).status_code == 200


# The MindIE coordinator API's own TGI example (docs/compatibility.md), typical_p 0.5 included.
SEED_TGI_PARAMETERS = {"decoder_input_details": False, "details": True, "do_sample": True, "max_new_tokens": 20,
                       "repetition_penalty": 1.03, "return_full_text": False, "seed": None, "temperature": 0.5,
                       "top_k": 10, "top_p": 0.95, "truncate": None, "typical_p": 0.5, "watermark": False,
                       "stop": None, "adapter_id": "None"}


@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
def test_the_seed_example_with_typical_p_is_served(http, path):
    resp = tgi(http, path, "My name is Olivier and I", **SEED_TGI_PARAMETERS)
    assert resp.status_code == 200, resp.text
    details = (resp.json() if path == "/generate" else json.loads(sse_events(resp.content)[-1]))["details"]
    assert details["finish_reason"] in ("length", "eos_token") and 1 <= details["generated_tokens"] <= 20


def test_typical_p_near_zero_keeps_one_token_a_step_so_every_seed_writes_the_same_text(http):
    def text(seed, **params):
        return tgi(http, "/generate", max_new_tokens=8, temperature=1.5, seed=seed, **params).json()["generated_text"]

    assert len({text(seed) for seed in (1, 2, 3)}) > 1  # sampled: the seeds differ
    assert len({text(seed, typical_p=1e-6) for seed in (1, 2, 3)}) == 1  # only the most typical token each step


def test_generate_body_with_both_or_neither_input_field_is_400(http):
    assert http.post("/generate", json={"inputs": "a", "prompt": "b"}).status_code == 400
    resp = http.post("/generate", json={"max_tokens": 3})
    assert resp.status_code == 400 and "exactly one of" in resp.json()["error"]


def test_decoder_input_details_cannot_stream(http):
    resp = http.post("/generate_stream", json={"inputs": "Hi", "parameters": {"decoder_input_details": True}})
    assert resp.status_code == 400 and "decoder_input_details" in resp.json()["error"]


@pytest.fixture(scope="module")
def hf_client(cluster):
    return InferenceClient(base_url=cluster.url)


def test_inference_client_text_generation_plain(hf_client, http):
    text = hf_client.text_generation("Hello there", max_new_tokens=5, do_sample=False)
    assert text == tgi(http, "/generate", max_new_tokens=5, do_sample=False).json()["generated_text"]


def test_inference_client_text_generation_with_details(hf_client):
    out = hf_client.text_generation("Hello there", max_new_tokens=5, details=True, seed=11, do_sample=True)
    assert out.details.finish_reason == "length" and out.details.generated_tokens == 5
    assert out.details.seed == 11 and len(out.details.tokens) == 5
    assert all(isinstance(t.id, int) and t.logprob <= 0 for t in out.details.tokens)


def test_inference_client_streaming(hf_client):
    chunks = list(hf_client.text_generation("Hello there", max_new_tokens=4, stream=True, details=True,
                                            do_sample=False))
    assert len(chunks) == 4
    assert all(isinstance(c.token.id, int) for c in chunks)
    assert chunks[-1].generated_text == "".join(c.token.text for c in chunks)
    assert chunks[-1].details.finish_reason == "length"


@pytest.mark.parametrize("path", ["/", "/generate_stream"])
@pytest.mark.parametrize("stream", [{}, "yes", 1])
def test_a_stream_flag_that_is_not_a_boolean_is_400(http, path, stream):
    resp = http.post(path, json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}, "stream": stream})
    assert resp.status_code == 400 and resp.json()["error"].startswith("stream: must be a boolean")
