"""Token ids to text deltas, and stop strings cut out before any of them reaches a client."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Emits the text each new token completes; holds bytes of an unfinished UTF-8 character.

    A fast tokenizer steps a Rust `DecodeStream` (one call per token); any other decodes the same window
    in Python. Both move the same offsets, so `flush` (and a fallback mid-stream) continue from either.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        # Decode a short window, not the whole output, so a step costs O(1) in output length:
        # ids[prefix_offset:read_offset] were emitted already and give the next token's text its context.
        self._prefix_offset = 0
        self._read_offset = 0
        self._rust = _rust_tokenizer(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._rust is not None else None

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                delta = self._stream.step(self._rust, token_id)
            except Exception:  # noqa: BLE001 - any refusal: the Python window from here on
                # The stream refuses a window whose text does not start with the text it had; the Python
                # window slices on regardless, as it always did.
                self._stream = None
            else:
                if delta is None:
                    return ""
                self._advance()
                return delta
        prefix, full = self._window()
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._advance()
            return full[len(prefix) :]
        return ""

    def resume(self, context: list[int], held: list[int]) -> None:
        """Continue an output another worker began: `context`'s text went out, `held`'s did not (the bytes of an
        unfinished character, or text kept back for a stop string): the next push emits it with its own text."""
        self._stream = None  # the Python window: it can start where the other worker's stood
        self._ids = list(context) + list(held)
        self._prefix_offset, self._read_offset = 0, len(context)

    def flush(self) -> str:
        """At the end of the output: the text still held (an unfinished character decodes as U+FFFD), so
        the whole output equals the tokenizer's decode of every id."""
        prefix, full = self._window()
        self._prefix_offset = self._read_offset = len(self._ids)
        self._stream = None  # its window cannot follow that jump; pushes after a flush take the Python path
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _window(self) -> tuple[str, str]:
        """The text of the emitted context, and of the context plus every token since."""
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip)
        return prefix, decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip)

    def _advance(self) -> None:
        """Text up to the last token went out: the window starts where the previous emission ended."""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)


def _rust_tokenizer(tokenizer):
    """The Rust tokenizer behind `tokenizer` when its `decode` is that tokenizer's own decode, else None."""
    # Imported here: a tokenizer has loaded transformers already; importers of this module need not.
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or cls.decode is not PreTrainedTokenizerFast.decode \
            or cls._decode is not PreTrainedTokenizerFast._decode:
        return None  # a subclass that post-processes the text: only its own decode says what it is
    rust = tokenizer.backend_tokenizer
    # transformers ignores clean_up_tokenization_spaces for BPE models unless forced; DecodeStream never cleans up.
    cleans_up = tokenizer.clean_up_tokenization_spaces and (
        type(rust.model).__name__ != "BPE"
        or getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
    return None if cleans_up else rust


class StopStringMatcher:
    """Releases text only once it cannot be the start of a stop string."""

    def __init__(self, stops: tuple[str, ...]):
        self._stops = tuple(s for s in stops if s)
        self._pending = ""
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, delta: str) -> str:
        """Add new text; return what is safe to emit. Sets `stopped` when a stop string matched."""
        if not self._stops:
            return delta
        self._pending += delta
        hits = [(i, s) for s in self._stops if (i := self._pending.find(s)) >= 0]
        if hits:
            index, self.matched = min(hits)
            released, self._pending = self._pending[:index], ""
            return released
        hold = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._pending)), hold, -1):
                if self._pending.endswith(stop[:n]):
                    hold = n
                    break
        released = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(released) :]
        return released

    def flush(self) -> str:
        """Release held text at the end of a sequence that did not stop on a stop string."""
        released, self._pending = self._pending, ""
        return released
