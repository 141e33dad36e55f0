"""Where the suite's time goes: CPU seconds (user + system) of each test's process and of the processes it reaped.

    pytest -p tests.cpu_account --cpu-account=FILE ...   # one JSON line per test, from every xdist worker
    python -m tests.cpu_account FILE                     # the modules and tests that cost most

A module-scoped fixture's processes are reaped at the module's end and count to its last test; the module totals
are the figure to read. CPU, not wall time: on a loaded machine a test waits longer but costs the same. Workers and
coordinators forked by the fork server (tests/fork_server.py) are its children, not the test's: run with
PDSERVE_TEST_FORK=0 to count them.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time

import pytest


def cpu_seconds() -> float:
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


def pytest_addoption(parser):
    parser.addoption("--cpu-account", metavar="FILE", default=None, help="append each test's CPU seconds to FILE")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.getoption("cpu_account")
    cpu, wall = cpu_seconds(), time.monotonic()
    yield
    if path:
        line = {"test": item.nodeid.split("@")[0], "module": item.module.__name__,
                "cpu": round(cpu_seconds() - cpu, 3), "wall": round(time.monotonic() - wall, 3)}
        with open(path, "a") as f:  # one short write per line: xdist workers append side by side
            f.write(json.dumps(line) + "\n")


def main(path: str, top: int = 40) -> None:
    rows = [json.loads(line) for line in open(path)]
    modules: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for row in rows:
        totals = modules[row["module"]]
        totals[0] += row["cpu"]
        totals[1] += row["wall"]
        totals[2] += 1
    print(f"{len(rows)} tests, {sum(r['cpu'] for r in rows):.0f} CPU s, {sum(r['wall'] for r in rows):.0f} wall s "
          f"(summed over workers), {os.cpu_count()} CPUs\n\n| CPU s | wall s | tests | module |\n|---:|---:|---:|---|")
    for name, (cpu, wall, count) in sorted(modules.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {cpu:.1f} | {wall:.1f} | {count} | {name} |")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
