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


# The packages pip installs (pyproject's packages.find), whose modules a newcomer reads; generated code aside.
PACKAGES = ("coordinator", "worker", "guidance", "kv_transfer", "security", "launcher", "embedded_model", "telemetry",
            "planner", "kv_events", "adapters", "docs_gen")
MAX_MODULE_LINES = 450
MAX_FOLDER_MODULES = 20  # past this, a folder's modules are grouped by stage into sub-folders
MAX_COORDINATOR_TOP_LEVEL = 12


def package_modules() -> list:
    return [m for package in PACKAGES for m in (REPO / package).rglob("*.py") if "_pb2" not in m.name]


def test_no_module_of_the_packages_passes_450_lines():
    long = {str(m.relative_to(REPO)): n for m in package_modules()
            if (n := len(m.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_package_folder_holds_more_than_20_modules_at_its_top_level():
    folders: dict[str, int] = {}
    for module in package_modules():
        if module.name != "__init__.py":
            folder = str(module.parent.relative_to(REPO))
            folders[folder] = folders.get(folder, 0) + 1
    assert {f: n for f, n in folders.items() if n > MAX_FOLDER_MODULES} == {}


def test_the_coordinators_top_level_holds_at_most_12_modules_the_rest_grouped_by_stage():
    top = [m.name for m in (REPO / "coordinator").glob("*.py") if m.name != "__init__.py"]
    assert len(top) <= MAX_COORDINATOR_TOP_LEVEL, sorted(top)
    for stage in ("http", "requests", "workers", "apis", "scheduling", "cluster"):
        assert (REPO / "coordinator" / stage / "__init__.py").is_file(), stage
