"""The TGI family's shared rules (TGI, MindIE, Triton, vLLM native), checked without a server."""

from __future__ import annotations

import pytest

from coordinator.apis.fields import parse_request
from coordinator.apis.mindie import MindieFormatter, MindieParameters, MindieRequest
from coordinator.apis.tgi import TgiFormatter, TgiParameters, TgiRequest
from coordinator.apis.triton import (
    TritonFormatter,
    TritonGenerateRequest,
    TritonParameters,
    TritonTokenFormatter,
)
from coordinator.apis.vllm_native import VllmFormatter
from coordinator.errors import ApiError
from coordinator.requests.serving import Transcript

FAMILY_BODIES = [
    (TgiRequest, {"inputs": "Hi"}),
    (MindieRequest, {"inputs": "Hi"}),
    (TritonGenerateRequest, {"text_input": "Hi"}),
]


@pytest.mark.parametrize("model,body", FAMILY_BODIES)
def test_watermark_is_refused_by_every_family_api(model, body):
    with pytest.raises(ApiError, match="parameters: watermark is not supported: only false is accepted"):
        parse_request(model, {**body, "parameters": {"watermark": True}})


@pytest.mark.parametrize("model,body", FAMILY_BODIES)
def test_unknown_parameters_are_refused_by_every_family_api(model, body):
    with pytest.raises(ApiError, match="parameters.best_of: unknown field"):
        parse_request(model, {**body, "parameters": {"best_of": 2}})


@pytest.mark.parametrize("params,temperature", [
    ({}, 0.0),
    ({"temperature": 0.5}, 0.5),
    ({"top_k": 5}, 1.0),
    ({"do_sample": True}, 1.0),
    ({"do_sample": False, "temperature": 0.5}, 0.0),
    ({"typical_p": 0.5}, 1.0),  # as in TGI, typical_p is a sampling parameter
    ({"typical_p": 1.0}, 0.0),
])
@pytest.mark.parametrize("model", [TgiParameters, MindieParameters, TritonParameters])
def test_family_is_greedy_unless_asked_to_sample(model, params, temperature):
    assert model(**params).sampling().temperature == temperature


@pytest.mark.parametrize("model", [TgiParameters, MindieParameters, TritonParameters])
def test_family_passes_typical_p_to_sampling_and_drops_it_when_greedy(model):
    assert model(typical_p=0.5, temperature=0.7).sampling().typical_p == 0.5
    assert model().sampling().typical_p == 1.0
    greedy = model(typical_p=0.5, do_sample=False).sampling()
    assert (greedy.temperature, greedy.typical_p) == (0.0, 1.0)


@pytest.mark.parametrize("model,body", FAMILY_BODIES)
@pytest.mark.parametrize("typical_p", [0, -0.5, 1.5, float("nan")])
def test_typical_p_outside_its_range_is_refused_by_every_family_api(model, body, typical_p):
    with pytest.raises(ApiError, match=r"parameters.typical_p: must be in \(0.0, 1.0\]") as info:
        parse_request(model, {**body, "parameters": {"typical_p": typical_p}})
    assert info.value.status == 400


def test_mindie_and_triton_carry_priority_and_timeout_into_the_request():
    for model in (MindieParameters, TritonParameters):
        gen = model(priority=2, timeout=30, max_new_tokens=7).generation("r", [1, 2])
        assert (gen.priority, gen.timeout_s, gen.max_tokens) == (2, 30, 7)


def test_tgi_reports_logprobs_and_passes_stop_strings():
    sampling = TgiParameters(stop=["a", "b"], seed=3).sampling()
    assert (sampling.logprobs, sampling.stop, sampling.seed) == (0, ("a", "b"), 3)


def test_family_error_frames_are_error_and_error_type():
    error = ApiError(503, "worker lost")
    frame = {"error": "worker lost", "error_type": "service_unavailable"}
    tgi = TgiFormatter(TgiRequest(inputs="Hi"), "Hi", [1], 1, False, str, frozenset(), list_ids=True)
    formatters = [tgi, MindieFormatter(MindieParameters(), 1, False), VllmFormatter("Hi", False),
                  TritonTokenFormatter("id", None)]
    for formatter in formatters:
        assert formatter.error_frames(error, Transcript()) == [frame]
    triton = TritonFormatter("id", "pdserve-tiny", TritonParameters(), False)
    assert triton.error_frames(error, Transcript()) == [{"id": "id", **frame}]
