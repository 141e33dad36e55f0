"""A generated token as the wire carries it: a pb.TokenEvent (a Decode call's message, or a token channel's
RoutedEvent), or a token channel's token record for the common token."""

from __future__ import annotations

from proto import worker_pb2 as pb
from proto.token_channel import MAX_RECORD_FIELD_BYTES, token_record
from worker.engine.sequence import StopCause, TokenOutput

_FINISH_TO_PB = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    StopCause.EOS: pb.FINISH_REASON_EOS,
    StopCause.STOP_STRING: pb.FINISH_REASON_STOP_STRING,
    StopCause.LENGTH: pb.FINISH_REASON_LENGTH,
    StopCause.STOP_TOKEN: pb.FINISH_REASON_STOP_TOKEN,
}


def token_to_pb(output: TokenOutput, event: pb.TokenEvent | None = None) -> pb.TokenEvent:
    """`output` as a TokenEvent, written into `event` when given (a field of the message that carries it)."""
    if event is None:
        event = pb.TokenEvent()
    event.token_id = output.token_id
    event.text = output.text
    event.time_ms = output.time_ms
    event.finish_reason = _FINISH_TO_PB[output.finish_reason]
    event.index = output.index
    event.matched_stop = output.matched_stop or ""
    event.batch_size = output.batch_size
    event.queue_wait_ms = output.queue_wait_ms
    if output.logprobs is not None:
        event.logprob = output.logprobs.logprob
        event.top_logprobs.extend(pb.TopLogprob(token_id=t, logprob=lp) for t, lp in output.logprobs.top)
    if output.prompt_logprobs:
        event.prompt_logprobs.extend(output.prompt_logprobs)
    return event


def relayed(request_id: str, output: TokenOutput, as_record: bool = False) -> pb.RoutedEvent | bytes:
    """A token as the token channel carries it: with `as_record`, the common token (mid-stream, no logprobs or
    prompt logprobs, no stop string; request id and text within MAX_RECORD_FIELD_BYTES) as a token record; else a
    RoutedEvent built in place (no TokenEvent copied into it)."""
    if (as_record and output.finish_reason is None and output.logprobs is None and output.matched_stop is None
            and output.prompt_logprobs is None):
        rid, text = request_id.encode(), output.text.encode()
        if len(rid) <= MAX_RECORD_FIELD_BYTES and len(text) <= MAX_RECORD_FIELD_BYTES:
            return token_record(rid, output.token_id, output.index, output.batch_size, output.time_ms,
                                output.queue_wait_ms, text)
    event = pb.RoutedEvent(request_id=request_id)
    token_to_pb(output, event.token)
    return event
