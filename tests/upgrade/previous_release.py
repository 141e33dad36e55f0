"""Release N-1 beside this tree: a git worktree of the previous release's commit, run with this interpreter and its
dependencies but its own sources, so tests can mix its processes with this tree's (release N).

"Its own install": every requirement of N-1's pyproject is this tree's too (`same_dependencies` checks it; what
this tree adds, e.g. the gateway's Envoy wheel, N-1 does not import), so N-1 needs no venv of its own, only its sources first on the path: its processes start in the worktree with
PYTHONPATH=<worktree>, which Python puts before site-packages and the editable install's finder (that finder is
on sys.meta_path after the PathFinder). They are spawned with subprocess, never forked from the fork server
(tests/fork_server.py), whose children run this tree's code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import REPO, ServerProcess, pdserve_argv, start_coordinator, start_worker

# The previous release's commit (release N-1 of the upgrade tests). Each release moves it to the commit it replaces.
PREVIOUS_RELEASE = "0e52718"


def tree_process(tree: Path, argv: list[str], ready_prefix: str) -> ServerProcess:
    """A pdserve process spawned in another source tree (`cwd` and PYTHONPATH there), never forked."""
    return ServerProcess(argv, ready_prefix, env=tree_environment(tree), cwd=tree)


def tree_environment(tree: Path) -> dict[str, str]:
    """This process's environment with `tree`'s sources first on the path (PDSERVE_CACHE and the rest shared: the
    embedded model, and the kernel library, which is named by its source's hash)."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(tree) + (os.pathsep + path if path else "")}


@dataclass(frozen=True)
class Release:
    """Where a release's workers and coordinators come from: this tree (`tree` None), or a worktree."""

    name: str
    tree: Path | None = None

    def worker(self, role: str, model_dir: Path, *extra: str) -> ServerProcess:
        if self.tree is None:
            return start_worker(role, model_dir, *extra)
        argv = pdserve_argv("worker", "--role", role, "--model", str(model_dir), "--port", "0", *extra)
        return tree_process(self.tree, argv, "pdserve worker ready:")

    def coordinator(self, config: Path) -> ServerProcess:
        if self.tree is None:
            return start_coordinator(config)
        return tree_process(self.tree, pdserve_argv("coordinator", "--config", str(config)),
                            "pdserve coordinator ready:")


CURRENT = Release("N")


def git(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)


def dependencies(pyproject: str) -> tuple:
    project = tomllib.loads(pyproject)["project"]
    return project.get("dependencies", []), project.get("optional-dependencies", {}), project.get("requires-python")


def _covered(theirs: tuple, ours: tuple) -> bool:
    """Whether every requirement of `theirs` (runtime, each extra, Python) is one `ours` states the same way: an
    environment installed for ours then runs theirs (what ours adds beside them does not matter)."""
    (runtime, extras, python), (our_runtime, our_extras, our_python) = theirs, ours
    return (set(runtime) <= set(our_runtime) and python == our_python
            and all(set(reqs) <= set(our_extras.get(name, ())) for name, reqs in extras.items()))


def same_dependencies(commit: str) -> str:
    """Why `commit` cannot run on this tree's environment (a requirement of its pyproject this tree's does not state
    alike); empty if it can."""
    shown = git("show", f"{commit}:pyproject.toml")
    if shown.returncode != 0:
        return f"no pyproject.toml at {commit}: {shown.stderr.strip()}"
    theirs, ours = dependencies(shown.stdout), dependencies((REPO / "pyproject.toml").read_text())
    if not _covered(theirs, ours):
        return (f"pyproject.toml's dependencies differ between {commit} and this tree, so release N-1 cannot share "
                f"this venv: give it an install of its own\n  {commit}: {theirs}\n  this tree: {ours}")
    return ""


def add_previous_release(base: Path, commit: str = PREVIOUS_RELEASE) -> Release:
    """A Release of `commit`, checked out under `base` (`git worktree add --detach`; `remove` takes it away).
    Raises PreviousReleaseMissing where it cannot be: the commit is not in this checkout's history (a shallow
    clone), or needs other dependencies."""
    found = git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    if found.returncode != 0:
        raise PreviousReleaseMissing(
            f"the previous release {commit} (PREVIOUS_RELEASE in tests/upgrade/previous_release.py) is not in this "
            f"checkout's history, and the upgrade tests run it: fetch the full history (CI: actions/checkout with "
            f"fetch-depth: 0; here: git fetch --unshallow)")
    why = same_dependencies(commit)
    if why:
        raise PreviousReleaseMissing(why)
    # A folder name of its own: git names the worktree after it, and pytest-xdist workers add theirs at once.
    tree = base / f"pdserve-{commit}-{os.getpid()}"
    added = git("worktree", "add", "--detach", str(tree), commit)
    if added.returncode != 0:
        raise PreviousReleaseMissing(f"git worktree add {tree} {commit} failed:\n{added.stderr}")
    try:
        check_imports_from(tree)
    except PreviousReleaseMissing:
        remove(tree)
        raise
    return Release("N-1", tree)


def remove(tree: Path) -> None:
    """Take a worktree `add_previous_release` made away (its folder and git's record of it)."""
    if git("worktree", "remove", "--force", str(tree)).returncode != 0:
        git("worktree", "prune")


class PreviousReleaseMissing(RuntimeError):
    """Release N-1 cannot be run here; the message says why and what to do."""


def check_imports_from(tree: Path) -> None:
    """A process started as the tree's are imports pdserve from the tree, not from this checkout. It also builds the
    tree's paged-attention kernel, once, before any of its workers starts under load: a no-op while the kernel's
    source is this tree's (the library is named by its source's hash); without a compiler workers do without."""
    modules = ("launcher.cli", "coordinator.http.server", "worker.service.serve", "proto.worker_pb2")
    script = (f"import {', '.join(modules)}\nprint({', '.join(m + '.__file__' for m in modules)})\n"
              "try:\n    from worker.torch_engine import kernels\n    kernels.build()\n"
              "except Exception as exc:\n    print('no kernel:', exc, file=__import__('sys').stderr)\n")
    probe = subprocess.run([sys.executable, "-c", script], cwd=tree, env=tree_environment(tree), capture_output=True,
                           text=True, timeout=600, check=False)
    files = probe.stdout.split()
    if probe.returncode != 0 or len(files) != len(modules) or not all(Path(f).is_relative_to(tree) for f in files):
        raise PreviousReleaseMissing(f"a process in {tree} does not import pdserve from it: "
                                     f"{probe.stdout}{probe.stderr}")
