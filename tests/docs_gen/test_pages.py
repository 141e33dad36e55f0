"""The generated reference pages are committed as the code renders them, and a stale one is told apart."""

from __future__ import annotations

from docs_gen.markdown import REGENERATE_COMMAND
from docs_gen.pages import GENERATED_PAGES, stale_pages, write_pages


def test_committed_reference_pages_match_the_code():
    stale = stale_pages()
    assert stale == [], f"stale generated pages {stale}: run `{REGENERATE_COMMAND}` and commit them"


def test_a_page_edited_by_hand_or_missing_is_stale(tmp_path):
    write_pages(tmp_path)
    edited, missing, *_ = GENERATED_PAGES
    (tmp_path / edited).write_text("edited by hand\n")
    (tmp_path / missing).unlink()
    assert sorted(stale_pages(tmp_path)) == sorted([edited, missing])


def test_writing_the_pages_changes_only_stale_ones(tmp_path):
    write_pages(tmp_path)
    first, *_ = GENERATED_PAGES
    (tmp_path / first).write_text("old\n")
    assert write_pages(tmp_path) == [first]
    assert stale_pages(tmp_path) == []
