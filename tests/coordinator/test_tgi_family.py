"""The TGI family's shared rules (TGI, MindIE, Triton, vLLM native), checked without a server."""

from __future__ import annotations

import pytest

from coordinator.apis.fields import parse_request
from coordinator.apis.mindie import MindieFormatter, MindieParameters, MindieRequest
from coordinator.apis.tgi import TgiFormatter, TgiParameters, TgiRequest
from coordinator.apis.tgi_family import check_model
from coordinator.apis.triton import (
    TritonFormatter,
    TritonGenerateRequest,
    TritonParameters,
    TritonTokenFormatter,
)
from coordinator.apis.vllm_native import VllmFormatter
from coordinator.errors import ApiError
from coordinator.serving import Transcript

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
])
@pytest.mark.parametrize("model", [TgiParameters, MindieParameters, TritonParameters])
def test_family_is_greedy_unless_asked_to_sample(model, params, temperature):
    assert model(**params).sampling().temperature == temperature


def test_mindie_and_triton_carry_priority_and_timeout_into_the_request():
    for model in (MindieParameters, TritonParameters):
        gen = model(priority=2, timeout=30, max_new_tokens=7).generation("r", [1, 2])
        assert (gen.priority, gen.timeout_s, gen.max_tokens) == (2, 30, 7)


def test_tgi_reports_logprobs_and_passes_stop_strings():
    sampling = TgiParameters(stop=["a", "b"], seed=3).sampling()
    assert (sampling.logprobs, sampling.stop, sampling.seed) == (0, ("a", "b"), 3)


def test_triton_names_the_model_it_does_not_serve():
    with pytest.raises(ApiError, match="not served here") as info:
        check_model("other", "pdserve-tiny")
    assert info.value.status == 404


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
