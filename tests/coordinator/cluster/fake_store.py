"""FakeStore: EtcdStore's calls over a dict, for unit tests of the cluster logic without an etcd process.

`down = True` makes every call fail as an unreachable etcd does; `expire(lease)` is a lease running out;
`failures` are raised by the next calls, one each (an exception the store let through: a bug, or worse).
"""

from __future__ import annotations

import itertools

from coordinator.cluster.etcd_store import Entry, EtcdUnavailable


class FakeStore:
    def __init__(self):
        self.endpoints = ["fake"]
        self.data: dict[str, Entry] = {}
        self.leases: set[int] = set()
        self.down = False
        self.reachable = True
        self.num_reconnects = 0
        self.calls: list[str] = []
        self.failures: list[BaseException] = []
        self._ids = itertools.count(1)
        self._revision = 0

    def _call(self, what: str) -> None:
        self.calls.append(what)
        if self.failures:
            raise self.failures.pop(0)
        if self.down:
            self.reachable = False
            raise EtcdUnavailable(f"{what}: down")
        if not self.reachable:
            self.reachable = True
            self.num_reconnects += 1

    def _set(self, key: str, value, lease: int) -> None:
        self._revision += 1
        self.data[key] = Entry(key, value.encode() if isinstance(value, str) else value, lease, self._revision)

    def expire(self, lease: int) -> None:
        self.leases.discard(lease)
        self.data = {k: e for k, e in self.data.items() if e.lease != lease}

    async def get(self, key):
        self._call("get")
        return self.data.get(key)

    async def get_prefix(self, prefix):
        self._call("get_prefix")
        return [e for k, e in sorted(self.data.items()) if k.startswith(prefix)]

    async def put(self, key, value, lease=0):
        self._call("put")
        if lease and lease not in self.leases:
            raise AssertionError(f"put on a dead lease {lease}")
        self._set(key, value, lease)

    async def delete(self, key):
        self._call("delete")
        return self.data.pop(key, None) is not None

    async def grant(self, ttl_s):
        self._call("grant")
        lease = next(self._ids)
        self.leases.add(lease)
        return lease

    async def refresh(self, lease):
        self._call("refresh")
        return lease in self.leases

    async def revoke(self, lease):
        self._call("revoke")
        self.expire(lease)

    async def create(self, key, value, lease=0):
        self._call("create")
        if key in self.data:
            return self.data[key]
        self._set(key, value, lease)
        return None

    def status(self):
        return {"reachable": self.reachable, "since": None, "error": "", "endpoints": self.endpoints}

    def close(self):
        pass
