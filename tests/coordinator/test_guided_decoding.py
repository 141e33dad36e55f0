"""Guided decoding through real workers: the embedded model's unconstrained output is gibberish, so every
guided output that parses, matches or validates shows the grammar was enforced on every token."""

from __future__ import annotations

import ast
import json
import re
import signal

import httpx
import jsonschema
import pytest

from tests.helpers import (BackgroundStream, management_url, sse_events, start_coordinator, start_worker,
                           write_config)

pytestmark = pytest.mark.system

MAX_TOKENS = 1000
LONG = {"maxIterTimes": MAX_TOKENS, "maxSeqLen": 2048, "maxInputTokenLen": 1024}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "fox"]}}}
EMAIL = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
# Arithmetic over small numbers: valid Python, so `ast` is an independent judge of the Lark grammar.
ARITHMETIC = 'start: expr\nexpr: NUM | expr OP expr | "(" expr ")"\nNUM: /[0-9]{1,3}/\nOP: "+" | "-" | "*"\n'
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city", "unit"],
                                                           "properties": {"city": {"enum": ["Oslo", "Paris"]},
                                                                          "unit": {"enum": ["C", "F"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "properties": {"zone": {"type": "string", "maxLength": 6}},
    "required": ["zone"]}}}


def served(coordinator, role: str) -> int:
    body = httpx.get(f"{management_url(coordinator)}/v1/instances", timeout=5).json()
    return sum(i["served"] for i in body[role])


@pytest.fixture(scope="module")
def coordinators(shared_coordinator):
    """name -> coordinator over the session's workers: through the prefill worker, or prefilled on the decode worker."""
    return {"prefill_worker": shared_coordinator(**LONG),
            "local_prefill": shared_coordinator({"digs_scheduler_config": {"local_prefill_max_tokens": 4096}}, **LONG)}


@pytest.fixture(params=["prefill_worker", "local_prefill"])
def coordinator(request, coordinators):
    return coordinators[request.param]


def complete(coordinator, body: dict, path: str = "/v1/completions") -> dict:
    resp = httpx.post(f"{coordinator.address}{path}", json={"model": "pdserve-tiny", "max_tokens": MAX_TOKENS,
                                                            **body}, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def streamed_text(coordinator, body: dict, path: str) -> tuple[str, str]:
    """The text a stream delivered and its finish reason."""
    raw = httpx.post(f"{coordinator.address}{path}", timeout=120, json={
        "model": "pdserve-tiny", "max_tokens": MAX_TOKENS, "stream": True, **body}).content
    payloads = sse_events(raw)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert not any("error" in c for c in chunks), chunks[-1]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    text = "".join(ch["delta"].get("content") or "" if "delta" in ch else ch["text"] for ch in choices)
    return text, choices[-1]["finish_reason"]


def text_of(body: dict) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


CONSTRAINTS = [
    ("json_schema", {"response_format": {"type": "json_schema",
                                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}}},
     lambda text: jsonschema.validate(json.loads(text), PERSON)),
    ("guided_json", {"guided_json": json.dumps(PERSON)}, lambda text: jsonschema.validate(json.loads(text), PERSON)),
    ("guided_regex", {"guided_regex": EMAIL}, lambda text: re.fullmatch(EMAIL, text) or pytest.fail(text)),
    ("guided_choice", {"guided_choice": ["red", "green", "blue sky"]},
     lambda text: text in ("red", "green", "blue sky") or pytest.fail(text)),
    ("guided_grammar", {"guided_grammar": ARITHMETIC}, lambda text: ast.parse(text, mode="eval")),
    ("structured_outputs", {"structured_outputs": {"regex": "[0-9]{4}-[0-9]{2}"}},
     lambda text: re.fullmatch("[0-9]{4}-[0-9]{2}", text) or pytest.fail(text)),
]


@pytest.mark.parametrize("name,fields,judge", CONSTRAINTS, ids=[c[0] for c in CONSTRAINTS])
@pytest.mark.parametrize("path,prompt", [("/v1/completions", {"prompt": "Write it:"}),
                                         ("/v1/chat/completions",
                                          {"messages": [{"role": "user", "content": "Write it."}]})],
                         ids=["completions", "chat"])
def test_guided_output_follows_its_constraint(coordinator, name, fields, judge, path, prompt):
    body = complete(coordinator, {**prompt, **fields, "temperature": 0}, path)
    assert body["choices"][0]["finish_reason"] == "stop"
    judge(text_of(body))


@pytest.mark.parametrize("name,fields,judge", CONSTRAINTS[::2], ids=[c[0] for c in CONSTRAINTS[::2]])
@pytest.mark.parametrize("path,prompt", [("/v1/completions", {"prompt": "Once"}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Go"}]})],
                         ids=["completions", "chat"])
def test_streamed_guided_output_follows_its_constraint_when_sampling(coordinator, name, fields, judge, path,
                                                                      prompt):
    text, finish = streamed_text(coordinator, {**prompt, **fields, "temperature": 1.0, "top_k": 50, "seed": 7},
                                 path)
    assert finish == "stop"
    judge(text)


def test_json_mode_output_is_a_json_object(coordinators):
    # Any object may have unbounded keys; this prompt's greedy object closes within the budget.
    body = complete(coordinators["prefill_worker"], {"prompt": "Once upon a time", "temperature": 0,
                                                     "response_format": {"type": "json_object"}})
    assert body["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(text_of(body)), dict)


def test_local_prefill_coordinator_never_uses_the_prefill_worker(coordinators, cluster):
    before = served(coordinators["local_prefill"], "prefill")
    complete(coordinators["local_prefill"], {"prompt": "Hi", "guided_choice": ["a", "b"], "temperature": 0})
    assert served(coordinators["local_prefill"], "prefill") == before


def test_each_of_n_choices_follows_the_schema_with_its_own_matcher(coordinators):
    body = complete(coordinators["prefill_worker"], {
        "messages": [{"role": "user", "content": "Who?"}], "n": 3, "temperature": 1.0, "seed": 11,
        "guided_json": PERSON}, "/v1/chat/completions")
    texts = [c["message"]["content"] for c in body["choices"]]
    assert len(texts) == 3 and len(set(texts)) > 1  # each choice samples its own path inside the grammar
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_logprobs_under_a_constraint_are_the_raw_distributions(coordinators):
    body = complete(coordinators["prefill_worker"], {"prompt": "Hi", "temperature": 0, "logprobs": 1,
                                                     "guided_choice": ["zzzz"], "max_tokens": 8})
    logprobs = body["choices"][0]["logprobs"]
    # The forced tokens are unlikely under the model: masked logprobs would all be 0.
    assert any(lp < -0.5 for lp in logprobs["token_logprobs"] if lp is not None)


@pytest.mark.parametrize("grammar,judge", [
    ({"type": "json", "value": PERSON}, lambda text: jsonschema.validate(json.loads(text), PERSON)),
    ({"type": "regex", "value": EMAIL}, lambda text: re.fullmatch(EMAIL, text) or pytest.fail(text)),
])
def test_tgi_grammar_is_enforced_on_every_tgi_route(coordinators, grammar, judge):
    url = coordinators["prefill_worker"].address
    body = {"inputs": "Answer:", "parameters": {"grammar": grammar, "max_new_tokens": MAX_TOKENS}}
    judge(httpx.post(f"{url}/generate", json=body, timeout=120).json()["generated_text"])
    judge(httpx.post(f"{url}/", json=body, timeout=120).json()[0]["generated_text"])
    events = [json.loads(p) for p in sse_events(httpx.post(f"{url}/generate_stream", json=body, timeout=120).content)]
    judge(events[-1]["generated_text"])


@pytest.mark.parametrize("tool_choice,names", [
    ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
    ("required", {"get_weather", "get_time"}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_has_arguments_that_validate(coordinators, tool_choice, names, stream):
    body = {"model": "pdserve-tiny", "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER, CLOCK],
            "tool_choice": tool_choice, "temperature": 0.8, "seed": 3, "max_tokens": MAX_TOKENS, "stream": stream}
    resp = httpx.post(f"{coordinators['prefill_worker'].address}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    if stream:
        chunks = [json.loads(p) for p in sse_events(resp.content)[:-1]]
        final = [c for c in chunks if c["choices"]][-1]["choices"][0]
        calls, finish = final["delta"]["tool_calls"], final["finish_reason"]
    else:
        choice = resp.json()["choices"][0]
        calls, finish = choice["message"]["tool_calls"], choice["finish_reason"]
    assert finish == "tool_calls" and calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for call in calls:
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


def test_a_resumed_reply_and_its_continuation_together_follow_the_schema(coordinators):
    partial = '{"name": "Al'
    body = complete(coordinators["prefill_worker"], {
        "messages": [{"role": "user", "content": "Who?"}], "resume_response": partial, "guided_json": PERSON,
        "temperature": 0}, "/v1/chat/completions")
    jsonschema.validate(json.loads(partial + text_of(body)), PERSON)


def test_a_resumed_reply_outside_the_schema_is_a_400_naming_it(coordinators):
    resp = httpx.post(f"{coordinators['prefill_worker'].address}/v1/chat/completions", timeout=30, json={
        "model": "pdserve-tiny", "messages": [{"role": "user", "content": "Who?"}], "resume_response": "Hello",
        "guided_json": PERSON})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "resume_response"


def test_a_grammar_that_does_not_compile_is_refused_before_any_worker_is_used(coordinators):
    coordinator = coordinators["prefill_worker"]
    before = served(coordinator, "prefill"), served(coordinator, "decode")
    resp = httpx.post(f"{coordinator.address}/v1/completions", timeout=30, json={
        "model": "pdserve-tiny", "prompt": "Hi", "guided_regex": "[a-"})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "guided_regex" and "unclosed character class" in error["message"]
    assert (served(coordinator, "prefill"), served(coordinator, "decode")) == before


def test_a_guided_stream_whose_decode_worker_dies_migrates_and_stays_inside_its_grammar(cluster, tmp_path):
    decodes = {w.address: w for w in (start_worker("decode", cluster.model_dir),
                                      start_worker("decode", cluster.model_dir))}
    coordinator = start_coordinator(write_config(tmp_path / "ms_coordinator.json", [cluster.prefill.address],
                                                 list(decodes), cluster.model_dir, **LONG))
    # About 650 tokens: still streaming when the kill lands; 250 numbers, each bounded.
    schema = {"type": "array", "minItems": 250, "maxItems": 250,
              "items": {"type": "integer", "minimum": 0, "maximum": 999}}
    body = {"model": "pdserve-tiny", "prompt": "Numbers:", "max_tokens": MAX_TOKENS, "temperature": 0,
            "guided_json": schema, "guided_whitespace_pattern": " ?"}
    try:
        uninterrupted = complete(coordinator, body)["choices"][0]["text"]
        jsonschema.validate(json.loads(uninterrupted), schema)
        reader = BackgroundStream(f"{coordinator.address}/v1/completions", {**body, "stream": True})
        assert reader.first_chunk.wait(30)
        busy = [i["address"] for i in httpx.get(f"{management_url(coordinator)}/v1/instances").json()["decode"]
                if i["outstanding_requests"]]
        decodes[busy[0]].proc.send_signal(signal.SIGKILL)
        reader.join(120)
        chunks = [json.loads(p) for p in sse_events(reader.raw)[:-1]]
        assert not any("error" in c for c in chunks), chunks[-1]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        jsonschema.validate(json.loads(text), schema)
        assert text == uninterrupted  # greedy: the migrated matcher replayed every token already sent
        migrations = httpx.get(f"{coordinator.address}/metrics").text
        assert "pdserve_request_migrations_total 1.0" in migrations
    finally:
        coordinator.stop()
        for worker in decodes.values():
            worker.stop()
