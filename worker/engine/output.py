"""Per-sequence output rules: text deltas, stop strings, EOS and length limits."""

from __future__ import annotations

from worker.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from worker.engine.sequence import Sequence, StopCause, TokenLogprobs, TokenOutput

RESUME_CONTEXT_TOKENS = 4  # tokens whose text went out, before a continued stream's held ones: their decode context


class OutputProcessor:
    """Appends each sampled token to its sequence and decides whether the sequence is done."""

    def __init__(self, seq: Sequence, tokenizer, eos_token_ids: frozenset[int]):
        self._seq = seq
        self._eos = eos_token_ids
        self._detok = IncrementalDetokenizer(tokenizer, seq.sampling.skip_special_tokens)
        self._stops = StopStringMatcher(seq.sampling.stop)
        held = seq.held_text_tokens
        if held:  # a continued stream: the text its last worker held back goes out with the next token's
            ids = seq.prompt_token_ids
            self._detok.resume(ids[max(0, len(ids) - held - RESUME_CONTEXT_TOKENS):len(ids) - held], ids[-held:])

    def append(self, token_id: int, time_ms: float, logprobs: TokenLogprobs | None = None, batch_size: int = 1,
               queue_wait_ms: float = 0.0) -> TokenOutput:
        seq = self._seq
        params = seq.sampling
        seq.output_token_ids.append(token_id)
        delta = self._detok.push(token_id)
        stop_token = token_id in params.stop_token_ids
        # A finished grammar allows nothing but EOS: ignore_eos cannot make it go on.
        grammar_done = seq.matcher is not None and seq.matcher.is_stopped()
        eos = token_id in self._eos and (not params.ignore_eos or grammar_done)
        if (stop_token or eos) and not params.include_stop_str_in_output:
            delta = ""
        text = self._stops.feed(delta)
        finish = None
        matched = None
        if self._stops.stopped:
            finish, matched = StopCause.STOP_STRING, self._stops.matched
            if params.include_stop_str_in_output:
                text += matched
        elif stop_token:
            finish, matched = StopCause.STOP_TOKEN, str(token_id)
        elif eos:
            finish = StopCause.EOS
        elif seq.num_generated >= params.max_tokens or seq.total_len >= seq.max_seq_len:
            finish = StopCause.LENGTH
        if finish is not None and finish is not StopCause.STOP_STRING:
            text += self._stops.feed(self._detok.flush()) + self._stops.flush()
        return TokenOutput(token_id, text, time_ms, seq.num_generated - 1, finish, matched, logprobs, batch_size,
                           queue_wait_ms)
