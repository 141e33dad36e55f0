"""Markdown pieces the generated pages share: table cells, tables and the generated-page banner."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence

REGENERATE_COMMAND = "make docs-reference"
ESCAPES = str.maketrans({"|": "\\|", "<": "&lt;", ">": "&gt;", "[": "\\[", "]": "\\]"})


def banner(sources: str) -> str:
    """The first lines of a generated page: where it comes from and how to regenerate it."""
    return (f"<!-- Generated from {sources} by `{REGENERATE_COMMAND}` (python -m docs_gen): do not edit by hand. -->\n")


def cell(text: str) -> str:
    """`text` safe in a table cell, on one line: outside code spans, pipes, angle brackets and square brackets
    (which Markdown would read as a link reference) escaped."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    return "".join(p if p.startswith("`") else p.translate(ESCAPES) for p in parts)


def code(value: object) -> str:
    """A value as inline code, JSON-spelt (strings quoted, booleans lowercase)."""
    text = value if isinstance(value, str) and value.startswith("--") else json.dumps(value)
    return f"`{text}`"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
