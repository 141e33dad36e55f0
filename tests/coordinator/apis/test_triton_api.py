"""Triton text and token endpoints: shapes from the MindIE API (docs/compatibility.md), id rules, perf_stat, ranges."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import sse_events

pytestmark = pytest.mark.system


def generate(http, stream=False, model="pdserve-tiny", **body):
    path = f"/v2/models/{model}/generate_stream" if stream else f"/v2/models/{model}/generate"
    return http.post(path, json={"text_input": "My name is", **body})


def test_generate_with_details_and_perf_stat(http):
    resp = generate(http, id="a123", parameters={"max_new_tokens": 5, "details": True, "perf_stat": True,
                                                  "do_sample": False})
    assert resp.status_code == 200
    body = resp.json()
    assert body["id"] == "a123" and body["model_name"] == "pdserve-tiny" and body["model_version"] is None
    details = body["details"]
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 5
    assert len(details["perf_stat"]) == 5 and all(len(p) == 2 and p[1] >= 0 for p in details["perf_stat"])
    assert details["first_token_cost"] > 0 and details["decode_cost"] >= 0


def test_generate_stream_events_grow_perf_stat_and_end_with_finish_reason(http):
    with http.stream("POST", "/v2/models/pdserve-tiny/generate_stream", json={
            "id": "s-1", "text_input": "My name is", "parameters": {"max_new_tokens": 4, "do_sample": False}}) as r:
        events = [json.loads(p) for p in sse_events(r.read())]
    assert len(events) == 4
    for i, event in enumerate(events):
        assert event["id"] == "s-1"
        assert event["details"]["generated_tokens"] == i + 1 and len(event["details"]["perf_stat"]) == i + 1
        assert event["details"]["batch_size"] >= 1 and event["details"]["queue_wait_time"] >= 0
        assert (event["prefill_time"] is None) == (i > 0) and (event["decode_time"] is None) == (i == 0)
    assert "finish_reason" not in events[0]["details"]
    assert events[-1]["details"]["finish_reason"] == "length"
    whole = generate(http, parameters={"max_new_tokens": 4, "do_sample": False}).json()["text_output"]
    assert "".join(e["text_output"] for e in events) == whole


def test_two_clients_may_use_the_same_id_at_once_and_each_gets_it_back(cluster):
    def call(_):
        with cluster.client() as client:
            return generate(client, id="same", parameters={"max_new_tokens": 8, "do_sample": False})

    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(call, range(4)))
    assert [r.status_code for r in responses] == [200] * 4
    assert all(r.json()["id"] == "same" for r in responses)


def test_token_infer_returns_inputs_then_generated_ids(http):
    ids = [42, 723, 117, 9]
    resp = http.post("/v2/models/pdserve-tiny/infer", json={
        "id": "42", "inputs": [{"name": "input0", "shape": [1, 4], "datatype": "UINT32", "data": ids}],
        "outputs": [{"name": "output0"}], "parameters": {"max_new_tokens": 6, "do_sample": False}})
    assert resp.status_code == 200
    body = resp.json()
    (out,) = body["outputs"]
    assert body["id"] == "42" and out["name"] == "output0" and out["datatype"] == "UINT32"
    assert out["data"][:4] == ids and len(out["data"]) == 10 and out["shape"] == [1, 10]


# The MindIE coordinator API's own Triton example (docs/compatibility.md), typical_p 0.5 included, but for its
# batch_size 100: one input per request.
SEED_TRITON_PARAMETERS = {"details": True, "do_sample": True, "max_new_tokens": 5, "repetition_penalty": 1.1,
                          "seed": 123, "temperature": 1, "top_k": 10, "top_p": 0.99, "typical_p": 0.5,
                          "watermark": False, "perf_stat": True, "priority": 5, "timeout": 10}


@pytest.mark.parametrize("stream", [False, True])
def test_the_seed_example_with_typical_p_is_served(http, stream):
    resp = generate(http, stream=stream, id="a123", text_input="My name is Olivier and I",
                    parameters=SEED_TRITON_PARAMETERS)
    assert resp.status_code == 200, resp.text
    body = json.loads(sse_events(resp.content)[-1]) if stream else resp.json()
    assert body["id"] == "a123" and body["details"]["generated_tokens"] == 5


def test_token_infer_takes_typical_p(http):
    resp = http.post("/v2/models/pdserve-tiny/infer", json={
        "inputs": [{"name": "input0", "shape": [3], "datatype": "UINT32", "data": [42, 723, 117]}],
        "outputs": [{"name": "output0"}], "parameters": {"max_new_tokens": 4, "typical_p": 0.5, "seed": 5}})
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["outputs"][0]["data"]) == 7


@pytest.mark.parametrize("body,needle", [
    ({"id": "bad id!"}, "id: must be 1 to 256 characters"),
    ({"id": "x" * 257}, "id: must be 1 to 256 characters"),
    ({"parameters": {"top_k": -1}}, "parameters.top_k"),
    ({"parameters": {"top_p": 0}}, "parameters.top_p"),
    ({"parameters": {"batch_size": 2}}, "only 1 is accepted"),
    ({"parameters": {"priority": 9}}, "parameters.priority"),
    ({"parameters": {"typical_p": 0}}, "parameters.typical_p: must be in (0.0, 1.0]"),
    ({"parameters": {"typical_p": 1.5}}, "parameters.typical_p: must be in (0.0, 1.0]"),
    ({"text_input": ""}, "text_input"),
])
def test_bad_triton_generate_input_is_400(http, body, needle):
    resp = generate(http, **body)
    assert resp.status_code == 400 and needle in resp.json()["error"]


@pytest.mark.parametrize("inputs,needle", [
    ([{"name": "input0", "shape": [1, 3], "datatype": "UINT32", "data": [1, 2]}], "does not describe 2 values"),
    ([{"name": "input0", "shape": [2], "datatype": "FP32", "data": [1, 2]}], "datatype"),
    ([{"name": "x", "shape": [1], "datatype": "UINT32", "data": [1]}], "must be named 'input0'"),
    ([{"name": "input0", "shape": [1], "datatype": "UINT32", "data": [10**6]}], "outside the vocabulary"),
])
def test_bad_triton_token_input_is_400(http, inputs, needle):
    resp = http.post("/v2/models/pdserve-tiny/infer", json={"inputs": inputs, "outputs": [{"name": "output0"}]})
    assert resp.status_code == 400 and needle in resp.json()["error"]


def test_unknown_triton_model_is_404(http):
    resp = generate(http, model="llama3-70b")
    assert resp.status_code == 404 and "no such model or LoRA adapter" in resp.json()["error"]
