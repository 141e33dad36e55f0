"""Speculative decoding's coordinator side on a real coordinator over simulated workers: a finished output sent as
a draft hint with the next request of the same prompt (and tenant), and x-pdserve-speculative on every API."""

from __future__ import annotations

import httpx
import pytest

from coordinator.http.route_table import ErrorStyle
from coordinator.http.routes import PREDICT_ROUTES
from security.api_keys import hash_key
from tests.coordinator.apis.test_fuzzed_bodies import VALID
from tests.helpers import scrape, start_coordinator, start_sim_worker, wait_for, write_config

pytestmark = pytest.mark.system

KEY_A, KEY_B = "sk-drafts-a-1f2e", "sk-drafts-b-3d4c"
HEADER = "x-pdserve-speculative"
GENERATION_PATHS = sorted(path for path in VALID if path != "/v1/tokenizer")


@pytest.fixture(scope="module")
def coordinator(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drafts")
    (tmp / "keys").write_text(f"{hash_key(KEY_A)} name=team-a\n{hash_key(KEY_B)} name=team-b\n")
    workers = [start_sim_worker("prefill"), start_sim_worker("decode")]
    sections = {"auth_config": {"api_keys_file": "keys"}, "speculative_config": {"enabled": True}}
    process = start_coordinator(write_config(tmp / "ms_coordinator.json", [workers[0].address],
                                             [workers[1].address], model_dir, sections=sections))
    yield process.address
    assert [p.stop() for p in (process, *workers)] == [0, 0, 0]


def metric(url: str, name: str) -> float:
    return scrape(url).get((name, ()), 0.0)


def complete(url: str, key: str, prompt: str, stream: bool = False) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60, headers={"Authorization": f"Bearer {key}"},
                      json={"model": "pdserve-tiny", "prompt": prompt, "max_tokens": 6, "stream": stream})


def test_a_second_identical_prompt_is_sent_the_first_ones_answer_as_a_hint_and_another_tenants_is_not(coordinator):
    url = coordinator
    prompt = "The lighthouse keeper counted the ships that passed in the night, one by one"
    sent = metric(url, "pdserve_draft_hints_sent_total")
    assert complete(url, KEY_A, prompt, stream=True).status_code == 200
    wait_for(lambda: metric(url, "pdserve_draft_corpus_entries") >= 1, what="the first output to be kept")
    assert complete(url, KEY_B, prompt).status_code == 200  # another tenant: team-a's answer is not its hint
    assert metric(url, "pdserve_draft_hints_sent_total") == sent
    assert complete(url, KEY_A, prompt).status_code == 200
    assert metric(url, "pdserve_draft_hints_sent_total") == sent + 1
    assert metric(url, "pdserve_draft_corpus_tokens") > 0


@pytest.mark.parametrize("path", GENERATION_PATHS)
def test_a_bad_speculative_header_is_a_400_in_each_apis_format_and_off_is_served(coordinator, path):
    url, auth = coordinator, {"Authorization": f"Bearer {KEY_A}"}
    bad = httpx.post(url + path, json=VALID[path], timeout=60, headers={**auth, HEADER: "sometimes"})
    assert bad.status_code == 400
    if PREDICT_ROUTES.error_style(path) is ErrorStyle.OPENAI:
        assert bad.json()["error"]["param"] == HEADER and "on or off" in bad.json()["error"]["message"]
    else:
        assert HEADER in bad.json()["error"] and "on or off" in bad.json()["error"]
    before = metric(url, "pdserve_requests_drafting_off_total")
    off = httpx.post(url + path, json=VALID[path], timeout=60, headers={**auth, HEADER: "off"})
    assert off.status_code == 200, off.text
    assert metric(url, "pdserve_requests_drafting_off_total") == before + 1
    assert httpx.post(url + path, json=VALID[path], timeout=60, headers={**auth, HEADER: "on"}).status_code == 200
