"""CoordinatorPicker on a coordinator built in-process (no worker is called): keys, tenants, sidecars, the subset
hint, the prefill header, fallbacks, model rewrites and the lease a pick holds until its stream closes."""

from __future__ import annotations

import asyncio
import json

import orjson
import pytest

from coordinator.config import parse_config
from coordinator.gateway.endpoint_pick import GatewayRequest, PickRefused
from coordinator.http.app import create_app
from coordinator.state import STATE
from security.api_keys import hash_key

PREFILL, DECODE_A, DECODE_B = "10.0.0.2:7000", "10.0.0.1:9000", "10.0.0.3:9000"
SIDECAR_A, SIDECAR_B = "10.0.0.1:8000", "10.0.0.3:8000"


@pytest.fixture
def picker(model_dir, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{hash_key('open-key')}\n{hash_key('tight-key')} name=tight concurrency=1\n")
    config = parse_config({
        "model_config": {"modelWeightPath": str(model_dir), "modelName": "pdserve-tiny"},
        "instances": {"prefill": [{"address": PREFILL}], "decode": [{"address": DECODE_A}, {"address": DECODE_B}]},
        "digs_scheduler_config": {"local_prefill_max_tokens": 0},
        "gateway_config": {"epp_port": 0},
        "auth_config": {"api_keys_file": str(keys)}})
    picker = create_app(config)[STATE].picker
    picker.sidecars.announce(DECODE_A, SIDECAR_A)
    picker.sidecars.announce(DECODE_B, SIDECAR_B)
    return picker


def request(body: dict | None = None, key: str = "open-key", subset: list[str] | None = None, **headers):
    raw = json.dumps(body if body is not None else {"model": "pdserve-tiny", "prompt": "Hello there"}).encode()
    return GatewayRequest({":path": "/v1/completions", ":method": "POST", "authorization": f"Bearer {key}",
                           **headers}, raw, subset)


def pick(picker, req):
    return asyncio.run(picker.pick(req))


def refused(picker, req) -> PickRefused:
    with pytest.raises(PickRefused) as caught:
        pick(picker, req)
    return caught.value


def test_a_pick_names_a_sidecar_then_the_other_as_fallback_and_the_prefill_worker(picker):
    chosen = pick(picker, request())
    assert sorted(chosen.endpoints) == [SIDECAR_A, SIDECAR_B] and chosen.destination == ",".join(chosen.endpoints)
    assert chosen.set_headers == {"x-prefiller-host-port": PREFILL} and chosen.body is None
    assert chosen.remove_headers == ["x-pdserve-kv-pull"]  # nothing to pull: a client's own is removed
    decode, prefill = picker.decode_behind(chosen.endpoints[0]), picker.registry.get("prefill", PREFILL)
    assert decode.outstanding_requests == 1
    prompt_tokens = len(picker.state.tokenizer.encode_now("Hello there"))
    assert (prefill.outstanding_requests, prefill.outstanding_prompt_tokens) == (1, prompt_tokens)
    chosen.served(chosen.endpoints[0])  # the response started: the prefill is done
    assert (prefill.outstanding_requests, decode.outstanding_requests) == (0, 1)
    chosen.close()
    chosen.close()
    assert decode.outstanding_requests == 0 and prefill.outstanding_prompt_tokens == 0


def test_the_fallback_that_served_carries_the_lease(picker):
    chosen = pick(picker, request())
    first, fallback = (picker.decode_behind(e) for e in chosen.endpoints)
    chosen.served(chosen.endpoints[1])
    assert (first.outstanding_requests, fallback.outstanding_requests) == (0, 1)
    chosen.close()
    assert fallback.outstanding_requests == 0


def test_the_subset_hint_limits_the_pick_and_one_naming_no_sidecar_is_a_503(picker):
    assert pick(picker, request(subset=[SIDECAR_B])).endpoints == [SIDECAR_B]
    refusal = refused(picker, request(subset=["10.9.9.9:8000"]))
    assert refusal.status == 503 and "subset hint" in refusal.message and refusal.headers["Retry-After"] == "1"


def test_a_decode_worker_without_a_live_sidecar_is_not_picked(picker):
    picker.sidecars.withdraw(DECODE_A, SIDECAR_A)
    assert pick(picker, request()).endpoints == [SIDECAR_B]
    picker.sidecars.withdraw(DECODE_B, SIDECAR_B)
    assert refused(picker, request()).status == 503


def test_a_missing_or_wrong_key_is_a_401_and_a_tenant_past_its_concurrency_a_429_until_its_pick_closes(picker):
    assert refused(picker, request(key="wrong")).status == 401
    held = pick(picker, request(key="tight-key"))
    refusal = refused(picker, request(key="tight-key"))
    assert refusal.status == 429 and "tenant tight" in refusal.message and "Retry-After" in refusal.headers
    held.close()
    pick(picker, request(key="tight-key")).close()


def test_a_model_rewrite_sends_the_body_on_with_the_new_model_and_an_unknown_model_is_a_404(picker):
    assert refused(picker, request({"model": "alias", "prompt": "Hi"})).status == 404
    rewritten = pick(picker, request({"model": "alias", "prompt": "Hi"},
                                     **{"x-llm-d-model-name-rewrite": "pdserve-tiny"}))
    assert orjson.loads(rewritten.body) == {"model": "pdserve-tiny", "prompt": "Hi"}


def test_a_client_cannot_name_the_prefill_worker_when_the_decode_worker_prefills(picker):
    picker.state.router.local_prefill_max_tokens = 10_000  # every prompt here is short: prefilled where it decodes
    chosen = pick(picker, request(**{"x-prefiller-host-port": "10.6.6.6:1"}))
    assert chosen.remove_headers == ["x-prefiller-host-port", "x-pdserve-kv-pull"] and not chosen.set_headers
