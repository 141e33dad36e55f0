"""A CPU allowance for one benchmarked process: a cgroup with a CFS quota of a share of one core (root only).

A process measured below saturation pays an idle wake-up per event that a busy one batches, so its CPU per
request says how loaded it was as much as what it costs; held to a share of a core it saturates, and its CPU per
request is the cost of a request at capacity, i.e. what requests/s per core means. Every pinned process of a run
gets the same share, each in a cgroup of its own."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

PERIOD_US = 10_000  # short, so a throttled process stalls for milliseconds, not a long burst per period
V1_ROOT, V2_ROOT = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")


class CpuQuota:
    """A cgroup holding `share` (0 < share <= 1) of one core for the processes added to it."""

    def __init__(self, share: float):
        if not 0 < share <= 1:
            raise ValueError(f"--cpu-share must be in (0, 1], got {share}")
        quota = int(PERIOD_US * share)
        name = f"pdserve-bench-{uuid.uuid4().hex[:8]}"
        if (V1_ROOT / "cpu.cfs_quota_us").exists():
            self.path = V1_ROOT / name
            self.path.mkdir()
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        elif "cpu" in (V2_ROOT / "cgroup.controllers").read_text(errors="replace").split():
            self.path = V2_ROOT / name
            self.path.mkdir()
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            raise RuntimeError("--cpu-share needs a cgroup cpu controller (v1 at /sys/fs/cgroup/cpu or v2)")

    def add(self, pid: int) -> None:
        """Move the process, all its threads and those it starts later, into the cgroup."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:  # a process still in it (it outlived its stop): left for the OS to reap
            pass


def check_available(share: float | None) -> None:
    """Fail before anything starts when a share is asked for and cannot be given."""
    if share is not None and os.geteuid() != 0:
        raise SystemExit("--cpu-share needs root (it makes a cgroup)")
