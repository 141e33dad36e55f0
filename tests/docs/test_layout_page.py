"""The Layout page (docs/design/layout.md) names every module of the packages it details, and nothing that is gone."""

from __future__ import annotations

import re

from tests.helpers import REPO

# Packages the Layout page lists module by module; the others get one line as a folder.
DETAILED = ("coordinator", "worker", "kv_transfer", "launcher", "docs_gen")


def layout_paths() -> set[str]:
    """Paths named in the page's layout block, built from each entry's indentation."""
    text = (REPO / "docs" / "design" / "layout.md").read_text()
    block = re.search(r"^```\n(.*?)^```", text, re.S | re.M).group(1)
    parents: list[str] = []
    paths = set()
    for line in block.splitlines():
        match = re.match(r"( *)(\S+)", line)
        name = match.group(2)
        if not (name.endswith("/") or name.endswith(".py")):
            continue  # a description's continuation line
        depth = len(match.group(1)) // 2
        parents = parents[:depth] + [name.rstrip("/")]
        paths.add("/".join(parents) + ("/" if name.endswith("/") else ""))
    return paths


def tree_paths() -> set[str]:
    paths = set()
    for package in DETAILED:
        for module in (REPO / package).rglob("*.py"):
            rel = module.relative_to(REPO)
            if module.name != "__init__.py":
                paths.add(str(rel))
            paths.update(str(parent) + "/" for parent in rel.parents if str(parent) != ".")
    return paths


def test_layout_page_lists_every_module_and_package_of_the_detailed_packages():
    listed = {p for p in layout_paths() if p.split("/")[0] in DETAILED}
    tree = tree_paths()
    assert sorted(tree - listed) == [], "modules missing from docs/design/layout.md"
    assert sorted(listed - tree) == [], "docs/design/layout.md names modules that do not exist"
