"""GET /openapi.json: the document covers every route of the predict port with the models that validate its
bodies, is valid OpenAPI 3.1, and real answers never contradict it (a valid request per operation, then
schemathesis against a coordinator with simulated workers)."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import subprocess
import sys
import time
import typing
from pathlib import Path

import httpx
import jsonschema
import pytest
from aiohttp.test_utils import TestClient, TestServer
from pydantic import BaseModel

from coordinator.apis import response_models
from coordinator.apis.openapi import build_document, operation_id
from coordinator.apis.operations import health_body, models_body
from coordinator.apis.tokenizer import tokenize_body
from coordinator.http.app import create_app
from coordinator.config import parse_config
from coordinator.http.error_response import ERROR_BODIES
from coordinator.errors import ApiError
from coordinator.http.route_table import ErrorStyle
from coordinator.http.routes import PREDICT_ROUTES
from tests.helpers import REPO, start_coordinator, start_sim_worker, sse_events, write_api_keys, write_config

MODEL = "pdserve-tiny"


@pytest.fixture(scope="module")
def document() -> dict:
    return build_document(PREDICT_ROUTES, MODEL)


def models_in(t) -> list[type[BaseModel]]:
    """The pydantic models a body type names: the model itself, or each member of a union (or a list's item)."""
    if isinstance(t, type) and issubclass(t, BaseModel):
        return [t]
    return [m for arg in typing.get_args(t) for m in models_in(arg)]


def refs_in(node) -> set[str]:
    if isinstance(node, dict):
        own = {node["$ref"].rsplit("/", 1)[-1]} if "$ref" in node else set()
        return own.union(*(refs_in(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(refs_in(v) for v in node))
    return set()


def validator(document: dict, schema: dict) -> jsonschema.Draft202012Validator:
    """`schema` (with its `#/components/...` references) as a validator; content keywords are not asserted."""
    return jsonschema.Draft202012Validator({**schema, "components": document["components"]})


def component(document: dict, name: str) -> jsonschema.Draft202012Validator:
    return validator(document, {"$ref": f"#/components/schemas/{name}"})


# --- The document, without a server ---

def test_the_document_is_valid_openapi_3_1(document):
    from schemathesis.specs.openapi.definitions import OPENAPI_31_VALIDATOR

    OPENAPI_31_VALIDATOR.validate(document)
    for schema in document["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)
    json.dumps(document, allow_nan=False)


def test_every_predict_route_is_an_operation_and_nothing_else(document):
    documented = {(method.upper(), path) for path, item in document["paths"].items() for method in item}
    assert documented == {(r.method, r.path) for r in PREDICT_ROUTES.routes}
    ids = [op["operationId"] for item in document["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids)) == len(PREDICT_ROUTES.routes)
    for route in PREDICT_ROUTES.routes:
        op = document["paths"][route.path][route.method.lower()]
        assert op["operationId"] == operation_id(route)
        assert route.reply is not None, f"{route.method} {route.path}: no reply documented"
        assert any(status.startswith("2") for status in op["responses"])
        assert {"401", "4XX", "500"} <= set(op["responses"])


def test_every_route_with_a_body_documents_its_request_model(document):
    for route in PREDICT_ROUTES.routes:
        op = document["paths"][route.path][route.method.lower()]
        if route.body_model is None:
            assert "requestBody" not in op
            continue
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert refs_in(body) == {m.__name__ for m in models_in(route.body_model)}


# Where the apis validate a body: `read_request(request, Model)` and `parse_request(Model, body)`.
BODY_VALIDATION = re.compile(r"(?:read_request\(\w+,\s*|parse_request\()(\w+)")


def test_every_model_a_handler_validates_a_body_into_is_a_documented_request_body():
    import coordinator.apis

    documented = {m for r in PREDICT_ROUTES.routes for m in models_in(r.body_model)}
    apis = Path(coordinator.apis.__file__).parent
    validated = set()
    for path in sorted(apis.glob("*.py")):
        module = sys.modules.get(f"coordinator.apis.{path.stem}")
        if module is None:
            continue
        for name in BODY_VALIDATION.findall(path.read_text()):
            if name in ("model_cls",):  # the helpers themselves
                continue
            validated.add(getattr(module, name))
    assert validated, "no body validation found: has read_request been renamed?"
    assert validated <= documented, f"validated but not documented: {sorted(m.__name__ for m in validated - documented)}"
    # A handler that validates its body itself documents exactly that model.
    for route in PREDICT_ROUTES.routes:
        names = BODY_VALIDATION.findall(inspect.getsource(route.handler))
        module = sys.modules[route.handler.__module__]
        for name in names:
            assert getattr(module, name) in models_in(route.body_model), f"{route.path}: reads {name}"


def test_every_request_models_schema_is_referenced_from_a_request_body(document):
    bodies = set().union(*(refs_in(item.get("requestBody", {})) for path in document["paths"].values()
                           for item in path.values()))
    for route in PREDICT_ROUTES.routes:
        for model in models_in(route.body_model):
            assert model.__name__ in bodies
            # The component is the model's own schema, field for field.
            own = model.model_json_schema(ref_template="#/components/schemas/{model}")
            own.pop("$defs", None)
            assert set(document["components"]["schemas"][model.__name__]["properties"]) == set(own["properties"])


def test_each_error_style_documents_the_body_its_routes_send(document):
    assert set(response_models.ERROR_BODY_MODELS) == set(ErrorStyle) == set(ERROR_BODIES)
    for style in ErrorStyle:
        check = component(document, response_models.ERROR_BODY_MODELS[style].__name__)
        for error in (ApiError(400, "bad", param="temperature"), ApiError(503, "no worker"),
                      ApiError(401, "invalid API key", error_type="authentication_error")):
            check.validate(ERROR_BODIES[style](error))
    for route in PREDICT_ROUTES.routes:
        op = document["paths"][route.path][route.method.lower()]
        name = response_models.ERROR_BODY_MODELS[route.error_style].__name__
        assert op["responses"]["4XX"]["$ref"].endswith(f"/{name}4XX")


def test_operation_bodies_match_their_schemas(document):
    component(document, "ModelList").validate(models_body(MODEL, 1700000000, 512))
    for instances in ({"prefill": [{"address": "a:1", "state": "healthy"}],
                       "decode": [{"address": "b:1", "state": "unhealthy"}]}, {"prefill": [], "decode": []}):
        component(document, "Health").validate(health_body(instances)[1])
    component(document, "TokenizeResponse").validate(tokenize_body(["He", "llo"]))


def test_openapi_json_is_served_and_keyed_like_v1_models(model_dir, tmp_path):
    keys = write_api_keys(tmp_path / "api_keys", ["sk-openapi"])
    app = create_app(parse_config({"model_config": {"modelWeightPath": str(model_dir)},
                                   "auth_config": {"api_keys_file": str(keys)}}))

    async def run():
        async with TestClient(TestServer(app)) as client:
            refused = await client.get("/openapi.json")
            models_refused = await client.get("/v1/models")
            ok = await client.get("/openapi.json", headers={"Authorization": "Bearer sk-openapi"})
            return refused.status, models_refused.status, ok.status, ok.content_type, await ok.json()

    refused, models_refused, status, content_type, served = asyncio.run(run())
    assert (refused, models_refused, status, content_type) == (401, 401, 200, "application/json")
    assert served["paths"].keys() == build_document(PREDICT_ROUTES).get("paths").keys()
    assert served["paths"]["/v1/models"]["get"]["security"] == [{"apiKey": []}]
    assert served["paths"]["/health"]["get"]["security"] == [{}, {"apiKey": []}]


# --- Against a coordinator with simulated workers ---

class SimCluster:
    def __init__(self, model_dir: Path, tmp: Path):
        self.prefill = start_sim_worker("prefill")
        self.decode = start_sim_worker("decode")
        self.coordinator = start_coordinator(write_config(tmp / "ms_coordinator.json", [self.prefill.address],
                                                          [self.decode.address], model_dir))
        self.url = self.coordinator.address

    def stop(self) -> list[int]:
        return [p.stop() for p in (self.coordinator, self.prefill, self.decode)]


@pytest.fixture(scope="module")
def sim(model_dir, tmp_path_factory):
    cluster = SimCluster(model_dir, tmp_path_factory.mktemp("openapi"))
    yield cluster
    assert cluster.stop() == [0, 0, 0]


def documented_response(document: dict, method: str, path: str, status: int) -> dict:
    item = document["paths"][path]
    # A method the path does not serve (405) answers in the error style of the path's operations.
    responses = (item.get(method.lower()) or next(iter(item.values())))["responses"]
    response = responses.get(str(status)) or responses.get(f"{status // 100}XX")
    assert response is not None, f"{method} {path}: status {status} is not documented"
    if "$ref" in response:
        response = document["components"]["responses"][response["$ref"].rsplit("/", 1)[-1]]
    return response


def check_against_document(document: dict, method: str, path: str, response: httpx.Response) -> None:
    """The answer's status, media type and body (each event's, for a stream) are those the document gives."""
    content = documented_response(document, method, path, response.status_code)["content"]
    media_type = response.headers["content-type"].split(";")[0].strip()
    assert media_type in content, f"{method} {path}: {media_type} not documented ({list(content)})"
    schema = content[media_type]["schema"]
    where = f"{method} {path} -> {response.status_code}"
    if media_type == "application/json":
        errors = list(validator(document, schema).iter_errors(response.json()))
        assert not errors, f"{where}: {errors[0].message} at {list(errors[0].absolute_path)}\n{response.text[:2000]}"
    elif media_type == "text/event-stream":
        data = schema["properties"]["data"]
        done, payload = (data["if"]["const"], data["else"]) if "if" in data else (None, data)
        check = validator(document, payload["contentSchema"])
        events = sse_events(response.content)
        assert events
        for i, event in enumerate(events):
            if event == done:
                assert i == len(events) - 1, f"{where}: {done} before the end"
                continue
            errors = list(check.iter_errors(json.loads(event)))
            assert not errors, f"{where}: event {i}: {errors[0].message} at {list(errors[0].absolute_path)}\n{event}"


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}
TGI = {"inputs": "Hello there", "parameters": {"max_new_tokens": 4}}
TRITON = {"text_input": "Hello there", "parameters": {"max_new_tokens": 4}}
# A valid request for every operation, and the variants whose answers differ in shape.
VALID = [
    ("GET", "/health", None, None),
    ("GET", "/health/live", None, None),
    ("GET", "/metrics", None, None),
    ("GET", "/v1/models", None, None),
    ("GET", "/openapi.json", None, None),
    ("POST", "/v1/chat/completions", None, CHAT),
    ("POST", "/v1/chat/completions", None, {**CHAT, "n": 2, "return_token_ids": True, "seed": 3}),
    ("POST", "/v1/chat/completions", None, {**CHAT, "stream": True,
                                           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("POST", "/v1/chat/completions", None, {**CHAT, "stream": True, "n": 2, "return_token_ids": True}),
    ("POST", "/v1/chat/completions", None, {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("POST", "/v1/completions", None, {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "echo": True}),
    ("POST", "/v1/completions", None, {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "n": 2,
                                       "best_of": 3, "return_token_ids": True}),
    ("POST", "/v1/completions", None, {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "stream": True,
                                       "stream_options": {"include_usage": True}}),
    ("POST", "/generate", None, {"inputs": "Hello there",
                                 "parameters": {"max_new_tokens": 4, "details": True, "decoder_input_details": True}}),
    ("POST", "/generate", None, TGI),
    ("POST", "/generate", None, {"prompt": "Hello there", "max_tokens": 4}),
    ("POST", "/generate_stream", None, TGI),
    ("POST", "/generate_stream", None, {**TGI, "parameters": {"max_new_tokens": 4, "details": True}}),
    ("POST", "/", None, {**TGI, "parameters": {"max_new_tokens": 4, "details": True}}),
    ("POST", "/", None, {**TGI, "stream": True}),
    ("POST", "/infer", None, {**TGI, "parameters": {"max_new_tokens": 4, "details": True}}),
    ("POST", "/infer", None, {**TGI, "stream": True}),
    ("POST", "/v2/models/{model}/generate", MODEL, TRITON),
    ("POST", "/v2/models/{model}/generate", MODEL,
     {**TRITON, "id": "req-1", "parameters": {"max_new_tokens": 4, "details": True, "perf_stat": True}}),
    ("POST", "/v2/models/{model}/generate_stream", MODEL, TRITON),
    ("POST", "/v2/models/{model}/infer", MODEL, {"inputs": [{"name": "input0", "shape": [1, 3], "datatype": "UINT32",
                                                            "data": [5, 6, 7]}], "outputs": [{"name": "output0"}]}),
    ("POST", "/v1/tokenizer", None, {"inputs": "Hello there"}),
]
# Simulated workers refuse token constraints (gRPC INVALID_ARGUMENT: a 400); a model worker serves them.
CONSTRAINED = [
    ("POST", "/v1/completions", None, {"model": MODEL, "prompt": "hi", "max_tokens": 4, "logit_bias": {"5": 1.0}}),
    ("POST", "/v1/chat/completions", None, {**CHAT, "guided_choice": ["yes", "no"]}),
    ("POST", "/generate", None, {**TGI, "parameters": {"max_new_tokens": 4, "grammar": {"type": "regex",
                                                                                      "value": "[ab]+"}}}),
]
# Refusals, one per error style and cause.
REFUSED = [
    ("POST", "/v1/chat/completions", None, {**CHAT, "temperature": -1}, 400),
    ("POST", "/v1/completions", None, {"model": "other", "prompt": "hi"}, 404),
    ("POST", "/generate", None, {"inputs": "hi", "prompt": "hi"}, 400),
    ("POST", "/v2/models/{model}/generate", "other", TRITON, 404),
    ("POST", "/v1/tokenizer", None, {"inputs": ""}, 400),
    ("GET", "/v1/chat/completions", None, None, 405),
]


def request(client: httpx.Client, method: str, path: str, model: str | None, body) -> httpx.Response:
    url = path.replace("{model}", model) if model else path
    return client.request(method, url, json=body) if body is not None else client.request(method, url)


@pytest.mark.system
def test_a_valid_request_on_every_operation_is_answered_as_documented(sim):
    with httpx.Client(base_url=sim.url, timeout=60) as client:
        document = client.get("/openapi.json").json()
        covered = set()
        for method, path, model, body in VALID:
            response = request(client, method, path, model, body)
            assert response.status_code == 200, f"{method} {path} {body}: {response.status_code} {response.text}"
            check_against_document(document, method, path, response)
            covered.add((method, path))
        for method, path, model, body in CONSTRAINED:
            response = request(client, method, path, model, body)
            assert response.status_code in (200, 400), f"{method} {path} {body}: {response.text}"
            check_against_document(document, method, path, response)
        for method, path, model, body, status in REFUSED:
            response = request(client, method, path, model, body)
            assert response.status_code == status, f"{method} {path} {body}: {response.status_code} {response.text}"
            check_against_document(document, method, path, response)
    assert covered == {(r.method, r.path) for r in PREDICT_ROUTES.routes}


# Steers generated bodies towards what the API accepts, so the run gets past validation into generation and
# its answers: the served model, a message's content (null is refused unless the message carries tool calls)
# and texts for the prompt fields. The schema does not carry the AfterValidator ranges nor cross-field rules.
SCHEMATHESIS_CONFIG = f"""
[dictionaries.prompt]
values = ["Hello there", "1 2 3 4 5", "Once upon a time"]

[parameters]
model = "{MODEL}"
"body.model" = "{MODEL}"
"body.messages[*].content" = "Hello there"
"body.prompt" = {{ dictionary = "prompt", probability = 0.7 }}
"body.inputs" = {{ dictionary = "prompt", probability = 0.7 }}
"body.text_input" = {{ dictionary = "prompt", probability = 0.7 }}

# The OpenAI bodies have the most fields: more examples there.
[[operations]]
include-path-regex = "^/v1/(chat/)?completions$"
generation = {{ max-examples = 30 }}
"""
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
# Failures schemathesis may report that are not taken as bugs, each dropped only when its case and answer match.
# A client's own `parameters.timeout` (MindIE, Triton) shorter than a generation ends it as documented: a 504,
# which `not_a_server_error` would count. (Three server bugs this test found are fixed, each with its own test:
# a vLLM stream sent as application/json, TGI grammar values that are not JSON, chat tool_calls without a function.)
SCHEMATHESIS_HOOKS = """
import schemathesis


def _body(case):
    return case.body if isinstance(case.body, dict) else {}


def _parameters(case):
    parameters = _body(case).get("parameters")
    return parameters if isinstance(parameters, dict) else {}


@schemathesis.hook
def filter_failure(context, failure, case, response):
    path, status = case.operation.path, response.status_code
    timeout = _parameters(case).get("timeout")
    if status == 504 and isinstance(timeout, (int, float)) and timeout < 1 and b"exceeded its deadline" in response.content:
        return False
    return True
"""


@pytest.mark.system
def test_schemathesis_finds_no_server_error_and_no_answer_that_contradicts_the_document(sim, tmp_path):
    (tmp_path / "schemathesis.toml").write_text(SCHEMATHESIS_CONFIG)
    (tmp_path / "openapi_accepted_failures.py").write_text(SCHEMATHESIS_HOOKS)
    argv = [str(Path(sys.executable).with_name("schemathesis")), "--config-file", "schemathesis.toml", "run",
            f"{sim.url}/openapi.json", "--checks", CHECKS, "--mode", "positive", "--max-examples", "15",
            "--seed", "20240601", "--workers", "1", "--phases", "examples,coverage,fuzzing",
            "--request-timeout", "30", "--report", "har", "--report-har-path", "report.har"]
    started = time.monotonic()
    run = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}", "NO_COLOR": "1",
                              "SCHEMATHESIS_HOOKS": "openapi_accepted_failures"})
    elapsed = time.monotonic() - started
    assert run.returncode == 0, f"schemathesis failed after {elapsed:.0f}s:\n{run.stdout[-12000:]}\n{run.stderr[-3000:]}"
    print(f"schemathesis ran {elapsed:.0f}s:\n{run.stdout[-1200:]}")  # shown with -s: cases, dropped failures
    entries = json.loads((tmp_path / "report.har").read_text())["log"]["entries"]
    successes = {e["request"]["url"].split("?")[0] for e in entries if e["response"]["status"] == 200}
    # The run reached past validation on every generation API.
    for path in ("/v1/chat/completions", "/v1/completions", "/generate_stream", "/infer", "/v1/tokenizer"):
        assert any(url.endswith(path) for url in successes), f"no 200 from {path}"
