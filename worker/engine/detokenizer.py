"""Token ids to text deltas, and stop strings cut out before any of them reaches a client."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Emits the text each new token completes; holds bytes of an unfinished UTF-8 character."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        # Decode a short window, not the whole output, so a step costs O(1) in output length.
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip)
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """At the end of the output: the text still held (an unfinished character decodes as U+FFFD), so
        the whole output equals the tokenizer's decode of every id."""
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip)
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip)
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


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
