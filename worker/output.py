"""Per-sequence output rules: text deltas, stop strings, EOS and length limits."""

from __future__ import annotations

from worker.detokenizer import IncrementalDetokenizer, StopStringMatcher
from worker.sequence import FinishReason, Sequence, TokenOutput


class OutputProcessor:
    """Appends each sampled token to its sequence and decides whether the sequence is done."""

    def __init__(self, seq: Sequence, tokenizer, eos_token_ids: frozenset[int]):
        self._seq = seq
        self._eos = eos_token_ids
        self._detok = IncrementalDetokenizer(tokenizer, seq.sampling.skip_special_tokens)
        self._stops = StopStringMatcher(seq.sampling.stop)

    def append(self, token_id: int, time_ms: float) -> TokenOutput:
        seq = self._seq
        seq.output_token_ids.append(token_id)
        text = self._stops.feed(self._detok.push(token_id))
        finish = None
        if self._stops.stopped:
            finish = FinishReason.STOP_STRING
        elif token_id in self._eos:
            finish = FinishReason.EOS
        elif seq.num_generated >= seq.sampling.max_tokens or seq.total_len >= seq.max_seq_len:
            finish = FinishReason.LENGTH
        if finish is not None and finish is not FinishReason.STOP_STRING:
            text += self._stops.flush()
        return TokenOutput(
            token_id=token_id,
            text=text,
            time_ms=time_ms,
            index=seq.num_generated - 1,
            finish_reason=finish,
            matched_stop=self._stops.matched,
        )
