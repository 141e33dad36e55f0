"""The generated pages: where each lives under docs/ and what renders it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from docs_gen import cli_reference, config_reference, life_cycles, metrics_reference, routes_reference

REPO = Path(__file__).resolve().parent.parent

GENERATED_PAGES: dict[str, Callable[[], str]] = {
    "docs/reference/configuration.md": config_reference.render,
    "docs/reference/cli.md": cli_reference.render,
    "docs/reference/metrics.md": metrics_reference.render,
    "docs/reference/http-routes.md": routes_reference.render,
    "docs/reference/life-cycles.md": life_cycles.render,
}


def stale_pages(repo: Path = REPO) -> list[str]:
    """The generated pages whose committed text differs from what the code renders now (or that are missing)."""
    stale = []
    for path, render in GENERATED_PAGES.items():
        page = repo / path
        if not page.exists() or page.read_text(encoding="utf-8") != render():
            stale.append(path)
    return stale


def write_pages(repo: Path = REPO) -> list[str]:
    """Render every generated page; return the paths whose text changed."""
    changed = []
    for path, render in GENERATED_PAGES.items():
        page, text = repo / path, render()
        if not page.exists() or page.read_text(encoding="utf-8") != text:
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_text(text, encoding="utf-8")
            changed.append(path)
    return changed
