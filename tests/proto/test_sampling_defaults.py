"""Sampling defaults are defined once (proto/sampling.py): the coordinator, the wire and a worker agree on them,
and each client API still applies its own before them."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.apis.fields import parse_request
from coordinator.apis.mindie import MindieRequest
from coordinator.apis.openai_chat import ChatCompletionRequest
from coordinator.apis.openai_completions import CompletionRequest
from coordinator.apis.tgi import TgiRequest
from coordinator.apis.triton import TritonGenerateRequest
from coordinator.apis.vllm_native import VllmGenerateRequest
from coordinator.requests.request import GenerationRequest, SamplingOptions
from coordinator.workers.request_messages import sampling_to_pb
from proto import worker_pb2 as pb
from proto.sampling import DEFAULT_SAMPLING, SamplingRules
from worker.engine.sequence import SamplingParams
from worker.service.request_checks import sampling_from_pb

SHARED = [f.name for f in dataclasses.fields(SamplingRules)]


def shared(rules) -> dict:
    return {name: getattr(rules, name) for name in SHARED}


def test_the_coordinator_and_a_worker_default_every_shared_rule_alike_to_greedy():
    assert shared(SamplingOptions()) == shared(SamplingParams()) == shared(DEFAULT_SAMPLING)
    assert DEFAULT_SAMPLING.temperature == 0.0


def test_default_options_reach_a_worker_as_its_defaults():
    sent = sampling_to_pb(GenerationRequest("r", [1], SamplingOptions()), 8)
    assert shared(sampling_from_pb(sent)) == shared(DEFAULT_SAMPLING)


# A value away from its default for every shared rule, exact in float32 (the wire's floats).
SET_RULES = dict(temperature=0.75, top_p=0.5, typical_p=0.25, top_k=5, seed=3, stop=("x",),
                 skip_special_tokens=False, repetition_penalty=1.25, presence_penalty=0.125, frequency_penalty=0.375,
                 stop_token_ids=(9,), ignore_eos=True, min_tokens=2, include_stop_str_in_output=True,
                 logit_bias=((4, -1.5),))


def test_every_shared_rule_set_away_from_its_default_reaches_a_worker_unchanged():
    assert set(SET_RULES) == set(SHARED)
    assert all(value != getattr(DEFAULT_SAMPLING, name) for name, value in SET_RULES.items())
    sent = sampling_to_pb(GenerationRequest("r", [1], SamplingOptions(**SET_RULES)), 8)
    assert shared(sampling_from_pb(sent)) == SET_RULES


def test_a_worker_reads_every_field_left_out_of_the_message_as_its_default_but_the_bool_it_cannot_tell():
    read = shared(sampling_from_pb(pb.SamplingParams()))
    differs = {name: value for name, value in read.items() if value != getattr(DEFAULT_SAMPLING, name)}
    assert differs == {"skip_special_tokens": False}


@pytest.mark.parametrize(("model", "body", "temperature"), [
    (CompletionRequest, {"model": "m", "prompt": "Hi"}, 1.0),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}, 1.0),
    (VllmGenerateRequest, {"prompt": "Hi"}, 1.0),
    (TgiRequest, {"inputs": "Hi"}, 0.0),
    (MindieRequest, {"inputs": "Hi"}, 0.0),
    (TritonGenerateRequest, {"text_input": "Hi"}, 0.0),
])
def test_each_api_keeps_its_own_default_temperature(model, body, temperature):
    request = parse_request(model, body)
    params = getattr(request, "parameters", request)
    assert params.sampling().temperature == temperature
