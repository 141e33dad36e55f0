"""Assistant text, as it streams, split into content, reasoning and tool calls.

Conventions: reasoning is the text inside `<think>...</think>`; a tool call is a JSON object
`{"name": ..., "arguments": {...}}` inside `<tool_call>...</tool_call>` (the Hermes/Qwen chat
template convention, which the embedded model's template also uses). A partial tag at the end of
a delta is held back until it is known, so no client ever sees half a tag.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ChatPiece:
    """What one delta released."""

    content: str = ""
    reasoning: str = ""


def _held_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that could start one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


@dataclass
class ChatOutputParser:
    """Feed text deltas; read content and reasoning back; tool calls once finished."""

    parse_tools: bool = False
    mode: str = "content"  # content | reasoning | tool
    pending: str = ""
    tool_text: str = ""
    raw_tool_calls: list[str] = field(default_factory=list)

    def feed(self, text: str, final: bool = False) -> ChatPiece:
        piece = ChatPiece()
        self.pending += text
        while self.pending:
            if self.mode == "content":
                opens = (THINK_OPEN, TOOL_OPEN) if self.parse_tools else (THINK_OPEN,)
                hits = [(i, t) for t in opens if (i := self.pending.find(t)) >= 0]
                if hits:
                    i, tag = min(hits)
                    piece.content += self.pending[:i]
                    self.pending = self.pending[i + len(tag):]
                    self.mode = "reasoning" if tag == THINK_OPEN else "tool"
                    continue
                keep = 0 if final else _held_suffix(self.pending, opens)
                piece.content += self.pending[: len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                break
            close = THINK_CLOSE if self.mode == "reasoning" else TOOL_CLOSE
            i = self.pending.find(close)
            if i >= 0:
                if self.mode == "reasoning":
                    piece.reasoning += self.pending[:i]
                else:
                    self.raw_tool_calls.append(self.tool_text + self.pending[:i])
                    self.tool_text = ""
                self.pending = self.pending[i + len(close):]
                self.mode = "content"
                continue
            keep = 0 if final else _held_suffix(self.pending, (close,))
            released = self.pending[: len(self.pending) - keep]
            self.pending = self.pending[len(self.pending) - keep:]
            if self.mode == "reasoning":
                piece.reasoning += released
            else:
                self.tool_text += released
            break
        if final and self.mode == "tool":
            # An unterminated tool call is not a call: give the text back as content.
            piece.content += TOOL_OPEN + self.tool_text
            self.tool_text, self.mode = "", "content"
        return piece

    def finish(self) -> ChatPiece:
        return self.feed("", final=True)

    def tool_calls(self) -> tuple[list[dict], str]:
        """Parsed calls in OpenAI's shape, and the text of blocks that were not valid calls."""
        calls, invalid = [], ""
        for raw in self.raw_tool_calls:
            try:
                obj = json.loads(raw)
                name, args = obj["name"], obj.get("arguments", {})
                if not isinstance(name, str):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                invalid += TOOL_OPEN + raw + TOOL_CLOSE
                continue
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": name,
                                       "arguments": args if isinstance(args, str) else json.dumps(args)}})
        return calls, invalid


def split_whole(text: str, parse_tools: bool) -> tuple[str, str, list[dict]]:
    """Content, reasoning and tool calls of a complete output."""
    parser = ChatOutputParser(parse_tools)
    a, b = parser.feed(text), parser.finish()
    calls, invalid = parser.tool_calls()
    return a.content + b.content + invalid, a.reasoning + b.reasoning, calls
