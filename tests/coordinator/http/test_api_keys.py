"""API keys on a real coordinator (simulated workers), through real clients: the openai SDK, httpx, TGI's format."""

from __future__ import annotations

import signal
import subprocess
import time

import httpx
import openai
import pytest

from tests.helpers import (REPO, pdserve_argv, scrape, start_coordinator, start_sim_worker, wait_for,
                           write_api_keys, write_config)

pytestmark = pytest.mark.system

KEY = "sk-pdserve-system-test-5f1c2a"
PROMPT = "The secret prompt about lighthouses"
CHALLENGE = 'Bearer realm="pdserve"'


class KeyedCluster:
    """Simulated workers behind two coordinators sharing one keys file: one with /health and /metrics open (the
    default), one with both closed."""

    def __init__(self, model_dir, tmp):
        self.keys_file = write_api_keys(tmp / "api_keys", [KEY])
        self.prefill = start_sim_worker("prefill")
        self.decode = start_sim_worker("decode")
        workers = [self.prefill.address], [self.decode.address]
        # A relative path: taken from the config file's folder.
        self.coordinator = start_coordinator(write_config(tmp / "open.json", *workers, model_dir,
                                                          sections={"auth_config": {"api_keys_file": "api_keys"}}))
        closed = {"auth_config": {"api_keys_file": str(self.keys_file), "open_health": False, "open_metrics": False}}
        self.closed = start_coordinator(write_config(tmp / "closed.json", *workers, model_dir, sections=closed))
        self.url = self.coordinator.address

    def stop(self) -> list[int]:
        return [p.stop() for p in (self.coordinator, self.closed, self.prefill, self.decode)]


@pytest.fixture(scope="module")
def keyed(model_dir, tmp_path_factory):
    cluster = KeyedCluster(model_dir, tmp_path_factory.mktemp("api_keys"))
    yield cluster
    assert cluster.stop() == [0, 0, 0, 0]


def sdk(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def auth_failures(url: str) -> dict[str, float]:
    return {dict(labels)["reason"]: value for (name, labels), value in scrape(url).items()
            if name == "pdserve_auth_failures_total"}


def test_openai_sdk_with_the_key_chats_and_completes(keyed):
    client = sdk(keyed.url, KEY)
    chat = client.chat.completions.create(model="pdserve-tiny", messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=4)
    assert chat.usage.completion_tokens == 4
    streamed = list(client.completions.create(model="pdserve-tiny", prompt=PROMPT, max_tokens=3, stream=True))
    assert streamed[-1].choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list()] == ["pdserve-tiny"]


def test_openai_sdk_with_a_wrong_key_gets_authentication_error(keyed):
    with pytest.raises(openai.AuthenticationError) as err:
        sdk(keyed.url, "sk-wrong").chat.completions.create(
            model="pdserve-tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=4)
    assert err.value.status_code == 401
    assert err.value.body == {"message": "invalid API key", "type": "authentication_error", "param": None,
                              "code": 401}
    with pytest.raises(openai.AuthenticationError):
        sdk(keyed.url, "sk-wrong").completions.create(model="pdserve-tiny", prompt=PROMPT, max_tokens=2)


def test_a_missing_key_is_a_401_with_a_challenge_in_openais_format(keyed):
    resp = httpx.post(f"{keyed.url}/v1/chat/completions", timeout=10,
                      json={"model": "pdserve-tiny", "messages": [{"role": "user", "content": PROMPT}]})
    assert resp.status_code == 401
    assert resp.headers["WWW-Authenticate"] == CHALLENGE
    assert resp.json() == {"error": {"message": "missing API key: send Authorization: Bearer <key>",
                                     "type": "authentication_error", "param": None, "code": 401},
                           "error_info": {"code": 401, "message": "missing API key: send Authorization: Bearer <key>"}}


def test_a_bare_key_in_authorization_is_accepted(keyed):
    resp = httpx.post(f"{keyed.url}/generate", headers={"Authorization": KEY}, timeout=30,
                      json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
    assert resp.status_code == 200, resp.text
    assert "generated_text" in resp.json()


def test_tgi_generate_with_a_wrong_key_is_a_401_in_tgis_format(keyed):
    resp = httpx.post(f"{keyed.url}/generate", headers={"Authorization": "Bearer nope"}, timeout=10,
                      json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
    assert resp.status_code == 401
    assert resp.headers["WWW-Authenticate"] == CHALLENGE
    assert resp.json() == {"error": "invalid API key", "error_type": "authentication_error"}


def test_an_unknown_path_is_a_401_not_a_404(keyed):
    assert httpx.get(f"{keyed.url}/no/such/route", timeout=10).status_code == 401
    assert httpx.get(f"{keyed.url}/no/such/route", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=10).status_code == 404


def test_health_and_metrics_are_open_by_default_and_closed_by_config(keyed):
    assert httpx.get(f"{keyed.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{keyed.url}/metrics", timeout=10).status_code == 200
    closed = keyed.closed.address
    for path in ("/health", "/metrics"):
        resp = httpx.get(closed + path, timeout=10)
        assert resp.status_code == 401
        assert resp.headers["WWW-Authenticate"] == CHALLENGE
        assert resp.json()["error_type"] == "authentication_error"
        assert httpx.get(closed + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=10).status_code == 200


def test_refusals_are_counted_by_reason(keyed):
    before = auth_failures(keyed.url)
    assert set(before) == {"missing", "malformed", "invalid"}
    for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": "Bearer x"}, {"Authorization": "x"}):
        assert httpx.post(f"{keyed.url}/v1/completions", headers=headers, json={}, timeout=10).status_code == 401
    after = auth_failures(keyed.url)
    assert {r: after[r] - before[r] for r in after} == {"missing": 1, "malformed": 1, "invalid": 2}


def test_sighup_reloads_the_keys_file(keyed, tmp_path):
    new_key = "sk-pdserve-rotated-77"
    headers = {"Authorization": f"Bearer {new_key}"}
    assert httpx.get(f"{keyed.url}/v1/models", headers=headers, timeout=10).status_code == 401
    write_api_keys(keyed.keys_file, [KEY, new_key])
    keyed.coordinator.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while httpx.get(f"{keyed.url}/v1/models", headers=headers, timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the new key is not accepted after SIGHUP"
        time.sleep(0.05)
    # A broken file on reload keeps the keys in use.
    keyed.keys_file.write_text(f"{new_key}\n")
    failed_reloads = "".join(keyed.coordinator.output).count("(with errors)")
    keyed.coordinator.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "".join(keyed.coordinator.output).count("(with errors)") > failed_reloads, 30,
             "the coordinator to log the reload that failed")
    assert httpx.get(f"{keyed.url}/v1/models", headers=headers, timeout=10).status_code == 200
    write_api_keys(keyed.keys_file, [KEY])


def test_keys_and_prompts_never_reach_the_coordinators_log(keyed):
    # Last in the module: every request above, accepted or refused, has gone through these coordinators.
    for coordinator in (keyed.coordinator, keyed.closed):
        output = "".join(coordinator.output)
        assert KEY not in output and "sk-pdserve-rotated-77" not in output
        assert PROMPT not in output


def test_a_broken_keys_file_stops_start_up_with_exit_code_2(model_dir, tmp_path):
    keys = tmp_path / "api_keys"
    keys.write_text(f"{KEY}\n")  # a key in plaintext instead of its digest
    config = write_config(tmp_path / "ms_coordinator.json", ["127.0.0.1:1"], ["127.0.0.1:2"], model_dir,
                          sections={"auth_config": {"api_keys_file": str(keys)}})
    done = subprocess.run(pdserve_argv("coordinator", "--config", str(config)), cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"auth_config.api_keys_file: {keys}: line 1:" in done.stderr
    assert KEY not in done.stderr + done.stdout
