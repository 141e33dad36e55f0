"""The coordinator's request in vLLM's terms: /v1/completions bodies for the NIXL handshake, and each streamed
chunk as the tokens (pb.TokenEvent's fields) a pdserve decode worker would have sent.

The prompt always goes as token ids: the coordinator tokenized it (chat template included), so a vLLM
instance computes exactly the prompt a pdserve worker would have. The handshake (vLLM's own proxy's):
  1. prefill instance: the prompt with `max_tokens: 1`, `stream: false` and `kv_transfer_params`
     `{"do_remote_decode": true, ...}`; its answer's `kv_transfer_params` say where the KV blocks wait;
  2. decode instance: the same request with those `kv_transfer_params` unchanged, streamed; it reads the blocks
     over NIXL and generates every token, the first included.
"""

from __future__ import annotations

from coordinator.requests.request import GenerationRequest
from proto import worker_pb2 as pb
from proto.plain_token import PlainTokenEvent

# What the prefill instance is told: hold the prompt's KV blocks for a decode instance to read.
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


class UnsupportedOnVllm(ValueError):
    """The request asks for something a vLLM instance cannot be told."""


class EngineError(Exception):
    """vLLM failed the request inside its stream: an `error` event, or finish_reason "abort"; `status` is the HTTP
    status the error names (None for an abort)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def completion_body(request: GenerationRequest, max_tokens: int, request_id: str, seeded_sampling: bool = True) -> dict:
    """The /v1/completions body for `request`'s prompt and sampling, streamed, with its token ids returned;
    `seeded_sampling` False: the fleet has CPU instances, which cannot sample from a client's seed."""
    s = request.sampling
    if request.media:
        raise UnsupportedOnVllm("images go to pdserve's own workers only: vLLM instances are served text prompts")
    if s.prompt_logprobs is not None:
        raise UnsupportedOnVllm("prompt logprobs (echo with logprobs, prompt_logprobs, decoder_input_details) are not "
                                "relayed from vLLM engines' prefill instances yet; leave them out")
    if s.typical_p < 1.0:
        raise UnsupportedOnVllm(f"typical_p={s.typical_p}: vLLM engines cannot honour typical_p (vLLM's sampling has "
                                "no locally typical filter); leave it out or at 1.0")
    body = {
        "prompt": request.prompt_token_ids,
        "max_tokens": max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "repetition_penalty": s.repetition_penalty,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "skip_special_tokens": s.skip_special_tokens,
        "ignore_eos": s.ignore_eos,
        "min_tokens": s.min_tokens,
        "include_stop_str_in_output": s.include_stop_str_in_output,
        "stream": True,
        "return_token_ids": True,
        "request_id": request_id,
    }
    if request.lora is not None:
        body["model"] = request.lora.name  # vLLM selects an adapter (its --lora-modules name) by `model`
    if s.top_k > 0:
        body["top_k"] = s.top_k
    if s.seed is not None and not s.seed_drawn:
        # A drawn seed stays here: vLLM's decode instance samples every token itself, and its CPU build fails a
        # seeded request whose prompt is split over steps (RuntimeError: CPU Generator does not use offset),
        # its engine with it.
        if s.temperature > 0 and not seeded_sampling:
            raise UnsupportedOnVllm(f"seed={s.seed} with temperature={s.temperature:g}: vLLM's CPU build cannot "
                                    "sample from a seed (its engine fails the request); leave seed out, or use "
                                    "temperature 0")
        body["seed"] = s.seed
    if s.stop:
        body["stop"] = list(s.stop)
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    if s.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in s.logit_bias}
    if s.logprobs is not None:
        # Alternatives named by id ("token_id:N"), never by text a token cannot be told apart by.
        body["logprobs"] = s.logprobs
        body["return_tokens_as_token_ids"] = True
    if s.guided is not None:
        if s.guided.generated:
            # vLLM starts a grammar from its beginning: the tokens an earlier attempt sent cannot be replayed into it.
            raise UnsupportedOnVllm("a guided request cannot continue on a vLLM instance after tokens were sent")
        body["structured_outputs"] = {"grammar": s.guided.grammar}  # llguidance text: the guidance backend's
    return body


def prefill_body(decode_body: dict) -> dict:
    """Step 1 of the handshake: the decode body, run to its first token only, its KV blocks kept for decode."""
    body = dict(decode_body, max_tokens=1, min_tokens=0, stream=False, kv_transfer_params=REMOTE_DECODE,
                request_id=decode_body["request_id"] + "-prefill")
    body.pop("logprobs", None)
    body.pop("return_tokens_as_token_ids", None)
    return body


class PlainToken(PlainTokenEvent):
    """The common chunk's token (one, mid-stream, without logprobs)."""

    __slots__ = ("token_id", "index", "time_ms", "text")

    def __init__(self, token_id: int, index: int, time_ms: float, text: str):
        self.token_id = token_id
        self.index = index
        self.time_ms = time_ms
        self.text = text


class ChunkReader:
    """Streamed completion chunks made tokens (PlainToken for the common chunk, else pb.TokenEvents), numbered from
    0 (a chunk may carry several tokens)."""

    __slots__ = ("index", "top_logprobs")

    def __init__(self, top_logprobs: int | None):
        self.index = 0
        self.top_logprobs = top_logprobs  # None: no logprobs asked for

    def events(self, chunk: dict, step_ms: float) -> list[pb.TokenEvent | PlainToken]:
        """The chunk's tokens; the chunk's text goes with its last one, the finish reason too."""
        choices = chunk.get("choices") or ()
        if not choices:
            error = chunk.get("error")
            if error:  # after its 200, vLLM reports a failed request as an event: a KV load that failed, say
                detail = error if isinstance(error, dict) else {"message": str(error)}
                status = detail.get("code")
                raise EngineError(str(detail.get("message") or detail), status if isinstance(status, int) else None)
            return []  # the usage chunk
        choice = choices[0]
        token_ids = choice.get("token_ids") or ()
        if not token_ids:
            return []
        if len(token_ids) == 1 and choice.get("finish_reason") is None and self.top_logprobs is None:
            index = self.index  # the common chunk: one token mid-stream, without logprobs
            self.index = index + 1
            token_id = token_ids[0]
            if token_id.__class__ is not int:  # as pb.TokenEvent would refuse it
                raise TypeError(f"token id {token_id!r} is not an integer")
            return [PlainToken(token_id, index, step_ms, choice.get("text", ""))]
        finish = _finish(choice.get("finish_reason"), choice.get("stop_reason"))
        logprobs = choice.get("logprobs") if self.top_logprobs is not None else None
        events = []
        last = len(token_ids) - 1
        for i, token_id in enumerate(token_ids):
            event = pb.TokenEvent(token_id=token_id, index=self.index, time_ms=step_ms if i == 0 else 0.0,
                                  text=choice.get("text", "") if i == last else "", batch_size=1)
            if i == last and finish is not None:
                event.finish_reason, stop = finish
                if stop:
                    event.matched_stop = stop
            if logprobs:
                _add_logprobs(event, logprobs, i, self.top_logprobs)
            events.append(event)
            self.index += 1
        return events


def _finish(reason: str | None, stop_reason) -> tuple[int, str] | None:
    if reason is None:
        return None
    if reason == "abort":
        raise EngineError("vLLM aborted the request")
    if reason == "length":
        return pb.FINISH_REASON_LENGTH, ""
    if isinstance(stop_reason, str):
        return pb.FINISH_REASON_STOP_STRING, stop_reason
    if isinstance(stop_reason, int):
        return pb.FINISH_REASON_STOP_TOKEN, str(stop_reason)
    return pb.FINISH_REASON_EOS, ""


def _token_of(name: str) -> int:
    return int(name.rpartition(":")[2])


def _add_logprobs(event: pb.TokenEvent, logprobs: dict, i: int, top: int) -> None:
    values = logprobs.get("token_logprobs") or ()
    if i < len(values) and values[i] is not None:
        event.logprob = values[i]
    tops = logprobs.get("top_logprobs") or ()
    if i < len(tops) and tops[i]:
        # vLLM adds the chosen token when it is not among the top ones: the client asked for `top`.
        for name, value in sorted(tops[i].items(), key=lambda item: -item[1])[:top]:
            event.top_logprobs.add(token_id=_token_of(name), logprob=value)
