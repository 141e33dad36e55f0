"""The README stays a first page: short, the quick start's commands, a folder list that matches the repository,
and links that lead somewhere. The module-level layout is checked on its own page (test_layout_page.py)."""

from __future__ import annotations

import fnmatch
import re

from tests.helpers import REPO

MAX_LINES = 250


def readme() -> str:
    return (REPO / "README.md").read_text()


def listed_folders() -> set[str]:
    """The folders named in the README's Layout block."""
    block = re.search(r"^## Layout\n.*?^```\n(.*?)^```", readme(), re.S | re.M).group(1)
    return {line.split()[0] for line in block.splitlines() if line.strip()}


def repository_folders() -> set[str]:
    """Top-level folders of the checkout that are part of the project: not hidden, not ignored by git."""
    ignored = [line.strip().rstrip("/") for line in (REPO / ".gitignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    return {f"{p.name}/" for p in REPO.iterdir()
            if p.is_dir() and not p.name.startswith(".")
            and not any(fnmatch.fnmatch(p.name, pattern) for pattern in ignored)}


def test_readme_is_at_most_250_lines():
    assert len(readme().splitlines()) <= MAX_LINES


def test_quick_start_gives_the_commands_to_run_and_test():
    quick_start = re.search(r"^## Quick start\n(.*?)^## ", readme(), re.S | re.M).group(1)
    for command in ("make run", "make test", "make test-unit", "curl", "openai.OpenAI("):
        assert command in quick_start, command


def test_layout_lists_every_top_level_folder_and_only_those():
    listed, present = listed_folders(), repository_folders()
    assert sorted(present - listed) == [], "folders missing from the README's Layout block"
    assert sorted(listed - present) == [], "the README's Layout block names folders that do not exist"


def test_every_relative_link_in_the_readme_leads_to_a_file():
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme())
    local = [t for t in targets if "://" not in t]
    assert local, "the README links into docs/"
    assert [t for t in local if not (REPO / t).exists()] == []
