"""Routable instances kept ordered by load, so the least loaded is read, not searched for, per request."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection

from coordinator.workers.instances import Instance, RolePool


def nth_outside(ordered: list[str], turn: int, exclude: Collection[str]) -> str | None:
    """The (turn mod count)-th of the sorted `ordered` that is not in `exclude`; None when all are.

    Costs O(|exclude| log n): the few excluded addresses (instances a request already failed on) are
    located by bisection and stepped over, instead of filtering the whole list.
    """
    if not exclude:
        return ordered[turn % len(ordered)] if ordered else None
    skipped = sorted(pos for address in exclude if (pos := _position(ordered, address)) is not None)
    count = len(ordered) - len(skipped)
    if count <= 0:
        return None
    k = turn % count
    for pos in skipped:
        if pos > k:
            break
        k += 1
    return ordered[k]


def _position(ordered: list[str], address: str) -> int | None:
    pos = bisect.bisect_left(ordered, address)
    return pos if pos < len(ordered) and ordered[pos] == address else None


class LoadOrder:
    """A pool's routable instances in buckets by load (addresses sorted in each), the loads sorted.

    The pool tells it of the instances whose load moved (RolePool.watch), and each is moved between two
    buckets by bisection, so the least loaded bucket is at hand in O(log n) instead of a scan of all.
    """

    def __init__(self, pool: RolePool, load: Callable[[Instance], float]):
        self.load = load
        self._pool = pool
        self._filed: dict[str, float] = {}  # address -> the load it is filed under
        self._buckets: dict[float, list[str]] = {}  # load -> addresses, sorted
        self._loads: list[float] = []  # the loads that have a bucket, ascending
        pool.watch(self)

    def admit(self, instance: Instance) -> None:
        self._file(instance.address, self.load(instance))

    def evict(self, instance: Instance) -> None:
        self._unfile(instance.address)

    def update(self, instance: Instance) -> None:
        load = self.load(instance)
        if self._filed.get(instance.address) != load:
            self._unfile(instance.address)
            self._file(instance.address, load)

    def least(self, exclude: Collection[str] = ()) -> tuple[float, list[str]] | None:
        """The lowest load of an instance outside `exclude`, and the addresses at that load (sorted; they
        may include excluded ones, see nth_outside); None when every instance is excluded."""
        self._pool.settle()
        if not exclude:
            if not self._loads:
                return None
            load = self._loads[0]
            return load, self._buckets[load]
        # Each excluded instance can empty at most one bucket, so this looks at |exclude| + 1 of them at most.
        for load in self._loads:
            bucket = self._buckets[load]
            if sum(1 for address in exclude if self._filed.get(address) == load) < len(bucket):
                return load, bucket
        return None

    def _file(self, address: str, load: float) -> None:
        self._filed[address] = load
        bucket = self._buckets.get(load)
        if bucket is None:
            self._buckets[load] = [address]
            bisect.insort(self._loads, load)
        else:
            bisect.insort(bucket, address)

    def _unfile(self, address: str) -> None:
        load = self._filed.pop(address, None)
        if load is None:
            return
        bucket = self._buckets[load]
        del bucket[bisect.bisect_left(bucket, address)]
        if not bucket:
            del self._buckets[load]
            del self._loads[bisect.bisect_left(self._loads, load)]
