"""The documentation site builds with `mkdocs build --strict`: no broken link or anchor, no page left out of nav."""

from __future__ import annotations

import logging

import pytest
from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort

from tests.helpers import REPO


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def build_site(config_file, site_dir) -> list[str]:
    """Build the site in-process into `site_dir`; the warnings that fail a strict build."""
    warnings = Warnings()
    logger = logging.getLogger("mkdocs")
    logger.addHandler(warnings)
    try:
        build(load_config(str(config_file), strict=True, site_dir=str(site_dir)))
    except Abort:
        pass  # strict mode's abort: the warnings say why
    finally:
        logger.removeHandler(warnings)
    return warnings.messages


@pytest.fixture(autouse=True)
def _no_mkdocs_2_notice(monkeypatch):
    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")  # material's notice on stderr, not a build warning


def test_site_builds_strictly(tmp_path):
    assert build_site(REPO / "mkdocs.yml", tmp_path / "site") == []
    assert (tmp_path / "site" / "index.html").exists()


def test_a_broken_link_or_a_page_outside_nav_fails_the_build(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n[gone](missing.md)\n")
    (tmp_path / "docs" / "stray.md").write_text("# Not in nav\n")
    settings = (REPO / "mkdocs.yml").read_text().split("\nnav:")[0]  # the real settings, a nav of one page
    (tmp_path / "mkdocs.yml").write_text(settings + "\nnav:\n  - index.md\n")
    warnings = build_site(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert any("missing.md" in w for w in warnings), warnings
    assert any("stray.md" in w for w in warnings), warnings

