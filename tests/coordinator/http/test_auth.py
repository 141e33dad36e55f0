"""The API key gate in the predict app, served in this process: 401s in each API's format, open paths, order."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from coordinator.http.app import create_app
from coordinator.http.auth import API_KEYS, load_api_keys
from coordinator.config import ConfigError, parse_config
from coordinator.metrics import METRICS
from security.api_keys import hash_key
from security.settings import AuthConfig
from tests.helpers import write_api_keys

KEY = "sk-test-gate-4242"
CHALLENGE = 'Bearer realm="pdserve"'


def make_app(model_dir, keys_file, **auth):
    config = {"model_config": {"modelWeightPath": str(model_dir)}, "request_limit": {"body_limit": 1},
              "auth_config": {"api_keys_file": str(keys_file), **auth}}
    return create_app(parse_config(config))


def call(app, *requests: tuple[str, str, dict]) -> list[tuple[int, dict, dict]]:
    """(method, path, keyword arguments) each -> (status, headers, JSON body or {})."""

    async def run():
        out = []
        async with TestClient(TestServer(app)) as client:
            for method, path, kwargs in requests:
                async with client.request(method, path, **kwargs) as resp:
                    body = await resp.json() if resp.content_type == "application/json" else {}
                    out.append((resp.status, dict(resp.headers), body))
        return out

    return asyncio.run(run())


@pytest.fixture
def keys_file(tmp_path):
    return write_api_keys(tmp_path / "api_keys", [KEY])


def test_no_keys_file_means_no_gate(model_dir):
    app = create_app(parse_config({"model_config": {"modelWeightPath": str(model_dir)}}))
    assert app[API_KEYS] is None
    [(status, _, _)] = call(app, ("POST", "/v1/chat/completions", {"json": {}}))
    assert status == 400


def test_refusals_are_401s_in_the_apis_own_format_with_a_challenge(model_dir, keys_file):
    app = make_app(model_dir, keys_file)
    results = call(app,
                   ("POST", "/v1/chat/completions", {"json": {}}),
                   ("POST", "/generate", {"json": {}, "headers": {"Authorization": "Bearer wrong"}}),
                   ("POST", "/v1/completions", {"json": {}, "headers": {"Authorization": "Bearer "}}))
    assert [r[0] for r in results] == [401, 401, 401]
    assert all(r[1]["WWW-Authenticate"] == CHALLENGE for r in results)
    assert results[0][2] == {"error": {"message": "missing API key: send Authorization: Bearer <key>",
                                       "type": "authentication_error", "param": None, "code": 401},
                             "error_info": {"code": 401,
                                            "message": "missing API key: send Authorization: Bearer <key>"}}
    assert results[1][2] == {"error": "invalid API key", "error_type": "authentication_error"}
    assert results[2][2]["error"]["message"].startswith("malformed Authorization header")
    sample = app[METRICS].registry.get_sample_value
    assert [sample("pdserve_auth_failures_total", {"reason": r}) for r in ("missing", "malformed", "invalid")] == \
        [1, 1, 1]
    # Refused before the request metrics: an unauthenticated client is not a generation request received.
    assert sample("pdserve_requests_received_total", {"api": "openai_chat"}) is None


def test_an_accepted_key_reaches_the_handler_bearer_or_bare(model_dir, keys_file):
    app = make_app(model_dir, keys_file)
    results = call(app, ("POST", "/v1/chat/completions", {"json": {}, "headers": {"Authorization": f"Bearer {KEY}"}}),
                   ("POST", "/v1/chat/completions", {"json": {}, "headers": {"Authorization": KEY}}),
                   ("GET", "/v1/models", {"headers": {"Authorization": f"bearer {KEY}"}}))
    assert [r[0] for r in results] == [400, 400, 200]  # 400: the empty body, judged only once the key passed


def test_two_authorization_headers_are_refused_as_malformed(model_dir, keys_file):
    app = make_app(model_dir, keys_file)
    headers = [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer other")]
    [(status, _, _)] = call(app, ("GET", "/v1/models", {"headers": headers}))
    assert status == 401
    assert app[METRICS].registry.get_sample_value("pdserve_auth_failures_total", {"reason": "malformed"}) == 1


def test_unknown_paths_and_methods_need_the_key_too(model_dir, keys_file):
    results = call(make_app(model_dir, keys_file), ("GET", "/no/such/path", {}), ("POST", "/v1/nothing", {}),
                   ("GET", "/v1/chat/completions", {}))
    assert [r[0] for r in results] == [401, 401, 401]
    assert "error_type" in results[0][2] and "message" in results[1][2]["error"]


def test_health_and_metrics_are_open_by_default_and_closed_by_config(model_dir, keys_file):
    opened = call(make_app(model_dir, keys_file), ("GET", "/health", {}), ("GET", "/metrics", {}),
                  ("HEAD", "/metrics", {}), ("POST", "/health", {}), ("GET", "/health/live", {}))
    assert [r[0] for r in opened] == [503, 200, 200, 401, 200]  # 503: no instances; POST is not the open route
    closed = call(make_app(model_dir, keys_file, open_health=False, open_metrics=False),
                  ("GET", "/health", {}), ("GET", "/metrics", {}),
                  ("GET", "/metrics", {"headers": {"Authorization": f"Bearer {KEY}"}}), ("GET", "/health/live", {}))
    assert [r[0] for r in closed] == [401, 401, 200, 401]
    assert closed[0][2] == {"error": "missing API key: send Authorization: Bearer <key>",
                            "error_type": "authentication_error"}


def test_a_refused_request_has_no_body_read(model_dir, keys_file):
    too_large = b"x" * (2 * 1024 * 1024)  # over body_limit=1 MB: reading it would be a 413
    results = call(make_app(model_dir, keys_file), ("POST", "/v1/completions", {"data": too_large}),
                   ("POST", "/v1/completions", {"data": too_large, "headers": {"Authorization": f"Bearer {KEY}"}}))
    assert [r[0] for r in results] == [401, 413]


def test_the_key_is_checked_before_the_in_flight_limit(model_dir, keys_file):
    app = make_app(model_dir, keys_file)
    [middleware] = app.middlewares  # one pass: RequestGate
    limit = middleware.__self__.limit
    limit.in_flight = limit.max_requests  # full: a keyed request is refused with 429, a keyless one with 401
    results = call(app, ("POST", "/v1/completions", {"json": {}}),
                   ("POST", "/v1/completions", {"json": {}, "headers": {"Authorization": f"Bearer {KEY}"}}))
    assert [r[0] for r in results] == [401, 429]


def test_a_broken_keys_file_is_a_config_error_naming_the_key_and_file(tmp_path):
    path = tmp_path / "api_keys"
    path.write_text(f"{hash_key(KEY)}\n{KEY}\n")
    with pytest.raises(ConfigError) as err:
        load_api_keys(AuthConfig(api_keys_file=str(path)))
    assert str(err.value).startswith(f"auth_config.api_keys_file: {path}: line 2:")
    assert KEY not in str(err.value)
    with pytest.raises(ConfigError, match=r"auth_config.api_keys_file: .*nowhere: cannot read"):
        load_api_keys(AuthConfig(api_keys_file=str(tmp_path / "nowhere")))


def test_the_apps_store_is_the_gates_so_a_reload_applies_at_once(model_dir, keys_file):
    app = make_app(model_dir, keys_file)
    write_api_keys(keys_file, ["new-key"])
    app[API_KEYS].reload()
    results = call(app, ("GET", "/v1/models", {"headers": {"Authorization": f"Bearer {KEY}"}}),
                   ("GET", "/v1/models", {"headers": {"Authorization": "Bearer new-key"}}))
    assert [r[0] for r in results] == [401, 200]
