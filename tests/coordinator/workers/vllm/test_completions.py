"""The coordinator's request as vLLM /v1/completions bodies, and vLLM's streamed chunks as pdserve token events."""

from __future__ import annotations

import pytest

from coordinator.requests.request import GenerationRequest, GuidedGrammar, MediaInput, SamplingOptions
from coordinator.workers.vllm.completions import (REMOTE_DECODE, ChunkReader, EngineError, UnsupportedOnVllm,
                                          completion_body, prefill_body)
from proto import worker_pb2 as pb


def request(**sampling) -> GenerationRequest:
    return GenerationRequest("req-1", [5, 6, 7], SamplingOptions(**sampling))


def test_the_body_carries_the_prompt_ids_and_every_sampling_rule():
    body = completion_body(request(temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=("x",), stop_token_ids=(9,),
                                   repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.3,
                                   min_tokens=2, ignore_eos=True, include_stop_str_in_output=True,
                                   skip_special_tokens=False, logit_bias=((4, -1.5),)), 12, "req-1")
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 12 and body["stream"] is True
    assert body["return_token_ids"] is True and body["request_id"] == "req-1"
    assert (body["temperature"], body["top_p"], body["top_k"], body["seed"]) == (0.7, 0.9, 5, 3)
    assert body["stop"] == ["x"] and body["stop_token_ids"] == [9] and body["logit_bias"] == {"4": -1.5}
    assert (body["repetition_penalty"], body["presence_penalty"], body["frequency_penalty"]) == (1.1, 0.2, 0.3)
    assert body["min_tokens"] == 2 and body["ignore_eos"] and body["include_stop_str_in_output"]
    assert body["skip_special_tokens"] is False


def test_top_k_off_and_no_seed_are_left_to_vllm_and_logprobs_come_as_token_ids():
    body = completion_body(request(logprobs=3), 4, "r")
    assert "top_k" not in body and "seed" not in body
    assert body["logprobs"] == 3 and body["return_tokens_as_token_ids"] is True


def test_a_seed_the_coordinator_drew_is_not_sent_to_vllm():
    assert "seed" not in completion_body(request(temperature=0.7, seed=99, seed_drawn=True), 4, "r")
    assert "seed" not in completion_body(request(temperature=0.7, seed=99, seed_drawn=True), 4, "r",
                                         seeded_sampling=False)


def test_a_clients_seed_with_sampling_is_refused_by_name_on_cpu_instances_and_sent_elsewhere():
    with pytest.raises(UnsupportedOnVllm, match="seed=7 with temperature=0.7: vLLM's CPU build cannot"):
        completion_body(request(temperature=0.7, seed=7), 4, "r", seeded_sampling=False)
    assert completion_body(request(temperature=0.0, seed=7), 4, "r", seeded_sampling=False)["seed"] == 7
    assert completion_body(request(temperature=0.7, seed=7), 4, "r")["seed"] == 7


def test_a_grammar_goes_as_structured_outputs_but_cannot_continue_after_sent_tokens():
    assert completion_body(request(guided=GuidedGrammar("start: /a+/")), 4, "r")["structured_outputs"] == {
        "grammar": "start: /a+/"}
    with pytest.raises(UnsupportedOnVllm, match="guided"):
        completion_body(request(guided=GuidedGrammar("start: /a+/", generated=(1,))), 4, "r")


def test_images_are_refused_by_name():
    media = MediaInput("image", b"x", 1, 0, 1, "image_url")
    with pytest.raises(UnsupportedOnVllm, match="images"):
        completion_body(GenerationRequest("r", [1], SamplingOptions(), media=(media,)), 4, "r")


def test_typical_p_is_refused_by_name_as_vllm_engines_cannot_honour_it():
    with pytest.raises(UnsupportedOnVllm, match="typical_p=0.5: vLLM engines cannot honour typical_p"):
        completion_body(request(temperature=1.0, typical_p=0.5), 4, "r")
    assert "typical_p" not in completion_body(request(temperature=1.0, typical_p=1.0), 4, "r")


def test_the_prefill_body_asks_for_one_token_kept_for_a_remote_decode():
    body = prefill_body(completion_body(request(logprobs=2, min_tokens=3), 20, "req-1"))
    assert body["max_tokens"] == 1 and body["min_tokens"] == 0 and body["stream"] is False
    assert body["kv_transfer_params"] == REMOTE_DECODE and body["request_id"] == "req-1-prefill"
    assert "logprobs" not in body


def chunk(token_ids, text="", finish=None, stop_reason=None, logprobs=None) -> dict:
    return {"choices": [{"index": 0, "text": text, "token_ids": token_ids, "finish_reason": finish,
                         "stop_reason": stop_reason, "logprobs": logprobs}]}


def test_a_chunk_of_several_tokens_numbers_each_and_gives_the_text_to_the_last():
    reader = ChunkReader(None)
    first = reader.events(chunk([11], "a"), 5.0)
    events = reader.events(chunk([12, 13], "bc", finish="length"), 2.0)
    assert [(e.index, e.token_id, e.text) for e in first + events] == [(0, 11, "a"), (1, 12, ""), (2, 13, "bc")]
    assert events[-1].finish_reason == pb.FINISH_REASON_LENGTH and not events[0].finish_reason
    assert reader.events({"choices": [], "usage": {}}, 0.0) == []


def test_a_token_id_that_is_not_an_integer_is_refused_even_in_the_common_chunk():
    with pytest.raises(TypeError):
        ChunkReader(None).events(chunk(["3"], "x"), 0.0)
    with pytest.raises(TypeError):
        ChunkReader(None).events(chunk(["3"], "x", finish="length"), 0.0)


@pytest.mark.parametrize("finish, stop_reason, reason, matched", [
    ("stop", None, pb.FINISH_REASON_EOS, ""),
    ("stop", "END", pb.FINISH_REASON_STOP_STRING, "END"),
    ("stop", 42, pb.FINISH_REASON_STOP_TOKEN, "42"),
])
def test_finish_reasons_map_onto_pdserves(finish, stop_reason, reason, matched):
    event = ChunkReader(None).events(chunk([1], finish=finish, stop_reason=stop_reason), 0.0)[0]
    assert (event.finish_reason, event.matched_stop) == (reason, matched)


def test_an_aborted_request_or_an_error_event_is_an_error_not_an_end():
    with pytest.raises(EngineError, match="aborted"):
        ChunkReader(None).events(chunk([1], finish="abort"), 0.0)
    with pytest.raises(EngineError, match="KV load failed") as error:
        ChunkReader(None).events({"error": {"message": "KV load failed", "code": 500}}, 0.0)
    assert error.value.status == 500


def test_logprobs_keep_the_asked_number_of_alternatives_best_first():
    logprobs = {"token_logprobs": [-0.5], "tokens": ["token_id:7"],
                "top_logprobs": [{"token_id:7": -0.5, "token_id:3": -2.0, "token_id:9": -1.0}]}
    event = ChunkReader(2).events(chunk([7], logprobs=logprobs), 0.0)[0]
    assert event.logprob == pytest.approx(-0.5)
    assert [(t.token_id, round(t.logprob, 3)) for t in event.top_logprobs] == [(7, -0.5), (9, -1.0)]
