"""MindIE native /infer: shapes as in the MindIE API (docs/compatibility.md), timing fields, ranges, and the per-request
timeout."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from tests.helpers import sse_events

pytestmark = pytest.mark.system


def infer(http, stream=False, **params):
    return http.post("/infer", json={"inputs": "My name is Olivier and I", "stream": stream, "parameters": params})


def test_infer_returns_text_and_details_as_in_the_seed(http):
    body = infer(http, max_new_tokens=6, details=True, seed=846930886, do_sample=True).json()
    assert set(body) == {"generated_text", "details"}
    assert body["details"] == {"finish_reason": "length", "generated_tokens": 6, "seed": 846930886}
    assert list(infer(http, max_new_tokens=2).json()) == ["generated_text"]


def test_infer_stream_events_carry_timings_and_the_last_the_result(http):
    with http.stream("POST", "/infer", json={"inputs": "Hello", "stream": True,
                                             "parameters": {"max_new_tokens": 5, "do_sample": False}}) as r:
        events = [json.loads(p) for p in sse_events(r.read())]
    assert len(events) == 5
    assert events[0]["prefill_time"] > 0 and events[0]["decode_time"] is None
    for event in events[1:]:
        assert event["prefill_time"] is None and event["decode_time"] >= 0
        assert isinstance(event["token"]["id"], list)
    last = events[-1]
    assert last["token"]["text"] is None
    assert last["details"]["finish_reason"] == "length" and last["details"]["generated_tokens"] == 5
    whole = http.post("/infer", json={"inputs": "Hello", "parameters": {"max_new_tokens": 5, "do_sample": False}})
    assert last["generated_text"] == whole.json()["generated_text"]
    streamed = "".join(e["token"]["text"] for e in events[:-1])
    assert last["generated_text"].startswith(streamed)


@pytest.mark.parametrize("params,needle", [
    ({"priority": 0}, "parameters.priority"),
    ({"priority": 6}, "parameters.priority"),
    ({"timeout": 0}, "parameters.timeout"),
    ({"timeout": 3601}, "parameters.timeout"),
    ({"temperature": 0}, "parameters.temperature"),
    ({"top_p": 1.0}, "parameters.top_p"),
    ({"typical_p": 0}, "parameters.typical_p: must be in (0.0, 1.0]"),
    ({"typical_p": 1.5}, "parameters.typical_p: must be in (0.0, 1.0]"),
    ({"watermark": True}, "watermark is not supported"),
    ({"stop": "x"}, "parameters.stop: unknown field"),
])
def test_out_of_range_infer_parameter_is_400(http, params, needle):
    resp = infer(http, **params)
    assert resp.status_code == 400 and needle in resp.json()["error"]


# The MindIE coordinator API's own /infer example (docs/compatibility.md), typical_p 0.5 included.
SEED_INFER_PARAMETERS = {"temperature": 0.5, "top_k": 10, "top_p": 0.95, "max_new_tokens": 20, "do_sample": True,
                         "seed": None, "repetition_penalty": 1.03, "details": True, "typical_p": 0.5,
                         "watermark": False, "priority": 5, "timeout": 10}


@pytest.mark.parametrize("stream", [False, True])
def test_the_seed_example_with_typical_p_is_served(http, stream):
    resp = infer(http, stream=stream, **SEED_INFER_PARAMETERS)
    assert resp.status_code == 200, resp.text
    body = json.loads(sse_events(resp.content)[-1]) if stream else resp.json()
    details = body["details"]
    assert details["finish_reason"] in ("length", "eos_token") and 1 <= details["generated_tokens"] <= 20


def test_request_past_its_timeout_ends_with_504_and_frees_the_decode_worker(http, cluster):
    resp = infer(http, max_new_tokens=10, timeout=0.001)
    assert resp.status_code == 504
    assert "deadline of 0.001s" in resp.json()["error"]
    deadline = time.monotonic() + 5
    while True:
        with grpc.insecure_channel(cluster.decode.address) as channel:
            h = pb_grpc.DecodeServiceStub(channel).Health(pb.HealthRequest(), timeout=5)
        if h.kv_used_tokens == 0 and h.num_running == 0:
            break
        assert time.monotonic() < deadline, h
        time.sleep(0.05)
    assert infer(http, max_new_tokens=2).status_code == 200
