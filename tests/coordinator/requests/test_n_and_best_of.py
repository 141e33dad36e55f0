"""n and best_of: several choices per request, seeded apart, ranked by logprob, streamed by index."""

from __future__ import annotations

import json

import pytest

from tests.helpers import sse_events

pytestmark = pytest.mark.system

BASE = {"model": "pdserve-tiny", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.3, "seed": 5}


def test_n_returns_n_distinct_reproducible_choices(http):
    body = http.post("/v1/completions", json={**BASE, "n": 3}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in body["choices"]]
    assert len(set(texts)) > 1
    assert body["usage"]["completion_tokens"] == 18
    assert [c["text"] for c in http.post("/v1/completions", json={**BASE, "n": 3}).json()["choices"]] == texts
    single = http.post("/v1/completions", json=BASE).json()["choices"][0]["text"]
    assert texts[0] == single  # choice 0 uses the request's own seed


def test_best_of_returns_the_n_most_likely_candidates(http):
    candidates = http.post("/v1/completions", json={**BASE, "n": 4, "logprobs": 0}).json()["choices"]
    scores = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in candidates}
    best = http.post("/v1/completions", json={**BASE, "n": 2, "best_of": 4}).json()
    chosen = [c["text"] for c in best["choices"]]
    assert chosen == sorted(scores, key=scores.get, reverse=True)[:2]
    assert all(c["logprobs"] is None for c in best["choices"])  # ranked internally, not asked for


def test_chat_n_streams_chunks_tagged_with_their_choice(http):
    body = {"model": "pdserve-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "temperature": 1.3, "seed": 9, "n": 2, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        payloads = sse_events(r.read())
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    by_index = {0: "", 1: ""}
    for c in chunks:
        by_index[c["choices"][0]["index"]] += c["choices"][0]["delta"]["content"]
    whole = http.post("/v1/chat/completions", json={**body, "stream": False}).json()
    assert [by_index[0], by_index[1]] == [c["message"]["content"] for c in whole["choices"]]
    finals = [c for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(c["choices"][0]["index"] for c in finals) == [0, 1]


@pytest.mark.parametrize("fields,needle", [
    ({"n": 0}, "n:"), ({"n": 129}, "n:"), ({"best_of": 129}, "best_of:"),
    ({"n": 3, "best_of": 2}, "best_of=2 must be >= n=3"),
    ({"n": 2, "best_of": 3, "stream": True}, "must equal n"),
])
def test_bad_n_and_best_of_are_400(http, fields, needle):
    resp = http.post("/v1/completions", json={**BASE, **fields})
    assert resp.status_code == 400 and needle in resp.json()["error"]["message"]
