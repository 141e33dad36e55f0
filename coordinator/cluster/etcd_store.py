"""EtcdStore: the few etcd operations the cluster needs, awaitable, with etcd's reachability tracked.

etcd is spoken to through its v3 JSON gateway with `etcd3gw` (plain HTTP over `requests`, so no second
grpcio/protobuf stack beside the workers' one). The client is synchronous: every call runs on a small
thread pool of its own with a short timeout, so an etcd that hangs never blocks the event loop, and never
takes the default executor's threads that tokenization runs on. etcd traffic is a few calls a second
per coordinator, never on a request's path.

Every call tries the endpoints in order, starting from the last one that answered, each for an equal share
of the timeout, so one call across all of them stays within it. An endpoint that gives no usable answer (no
connection, a timeout, a connection cut mid-reply, a reply that is not JSON) is passed over; a call that
reaches none raises EtcdUnavailable and marks the store unreachable (logged once); the next call that gets
an answer marks it reachable again and counts a reconnection, which tells the registry sync to resync.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

import requests
import urllib3.exceptions
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception
from etcd3gw.lease import Lease
from etcd3gw.utils import _encode

from security.settings import TlsLink

logger = logging.getLogger(__name__)

# Concurrent etcd calls of one coordinator: the leader refresh, the sync's read and a few writes.
NUM_THREADS = 4

# No usable answer from an endpoint, beyond the Timeout and ConnectionError that etcd3gw wraps itself: a
# connection cut mid-reply (requests' ChunkedEncodingError and the other RequestExceptions, urllib3's and
# http.client's errors, socket errors), a reply body that is not JSON (ValueError). Each means "try the next
# endpoint", like a refused connection; anything else (KeyError, TypeError, ...) is a bug, left to the
# loops' catch-alls, which log it with its traceback.
NO_ANSWER = (ConnectionFailedError, ConnectionTimeoutError, requests.RequestException, OSError, ValueError,
             http.client.HTTPException, urllib3.exceptions.HTTPError)


class EtcdError(Exception):
    """etcd answered, but refused the call (e.g. a lease that no longer exists)."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered within the timeout."""


@dataclass(frozen=True)
class Entry:
    """One key as etcd holds it."""

    key: str
    value: bytes
    lease: int  # 0 = none
    mod_revision: int


def _entry(value: bytes, meta: dict) -> Entry:
    key = meta["key"]
    return Entry(key.decode() if isinstance(key, bytes) else key, value, int(meta.get("lease", 0)),
                 int(meta.get("mod_revision", 0)))


def make_client(url: str, timeout_s: float, tls: TlsLink | None) -> Etcd3Client:
    """A client of one endpoint. The API path is fixed to /v3/ (etcd 3.4 and later), saving a /version call."""
    parts = urlsplit(url)
    session = requests.Session()
    # requests lets REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE (set in many images) override a session's `verify`,
    # and HTTP(S)_PROXY reroute it: etcd's trust is tls_config.etcd alone, and it is dialled directly.
    session.trust_env = False
    if parts.scheme == "https" and tls is not None:
        session.verify = tls.ca_cert or True
        if tls.mutual_tls:
            session.cert = (tls.tls_cert, tls.tls_key)
    return Etcd3Client(host=parts.hostname, port=parts.port, protocol=parts.scheme, timeout=timeout_s,
                       api_path="/v3/", session=session)


class EtcdStore:
    """Async etcd calls over one or more endpoints; `reachable`, `unreachable_since` and `last_error` say how
    the last call went."""

    def __init__(self, endpoints: list[str], timeout_s: float, tls: TlsLink | None = None,
                 clients: list[Etcd3Client] | None = None):
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s  # the most one call may take, across every endpoint
        per_endpoint_s = timeout_s / max(1, len(endpoints))
        self._clients = clients if clients is not None else [make_client(u, per_endpoint_s, tls) for u in endpoints]
        self._current = 0  # the endpoint that answered last
        self._executor = ThreadPoolExecutor(max_workers=NUM_THREADS, thread_name_prefix="etcd")
        self.reachable = True  # until a call says otherwise
        self.unreachable_since: float | None = None  # wall-clock time of the first failed call of an outage
        self.last_error = ""
        self.num_reconnects = 0  # outages that ended: each asks for a resync

    def status(self) -> dict:
        """etcd as /health reports it."""
        return {"reachable": self.reachable, "since": self.unreachable_since, "error": self.last_error,
                "endpoints": self.endpoints}

    async def _call(self, what: str, fn: Callable[[Etcd3Client], Any]) -> Any:
        loop = asyncio.get_running_loop()
        errors = []
        for i in range(len(self._clients)):
            index = (self._current + i) % len(self._clients)
            try:
                result = await loop.run_in_executor(self._executor, fn, self._clients[index])
            except NO_ANSWER as exc:
                errors.append(f"{self.endpoints[index]}: {type(exc).__name__}")
                continue
            except Etcd3Exception as exc:  # an HTTP error status: etcd answered no
                self._answered(index)
                raise EtcdError(f"etcd refused {what}: {exc.detail_text or type(exc).__name__}") from None
            self._answered(index)
            return result
        self._unanswered(f"{what}: " + "; ".join(errors))
        raise EtcdUnavailable(self.last_error)

    def _answered(self, index: int) -> None:
        self._current = index
        if not self.reachable:
            logger.warning("etcd reachable again at %s (unreachable for %.1fs)", self.endpoints[index],
                           time.time() - (self.unreachable_since or time.time()))
            self.reachable, self.unreachable_since, self.last_error = True, None, ""
            self.num_reconnects += 1

    def _unanswered(self, error: str) -> None:
        self.last_error = error
        if self.reachable:
            logger.warning("etcd unreachable: %s; serving from what this coordinator knows", error)
            self.reachable, self.unreachable_since = False, time.time()

    async def get(self, key: str) -> Entry | None:
        found = await self._call(f"get {key}", lambda c: c.get(key, metadata=True))
        return _entry(*found[0]) if found else None

    async def get_prefix(self, prefix: str) -> list[Entry]:
        found = await self._call(f"get {prefix}*", lambda c: c.get_prefix(prefix))
        return [_entry(value, meta) for value, meta in found]

    async def put(self, key: str, value: str | bytes, lease: int = 0) -> None:
        await self._call(f"put {key}", lambda c: c.put(key, value, lease=Lease(lease, c) if lease else None))

    async def delete(self, key: str) -> bool:
        return await self._call(f"delete {key}", lambda c: c.delete(key))

    async def grant(self, ttl_s: float) -> int:
        """A new lease of `ttl_s` (rounded up to whole seconds, as etcd counts them); its id."""
        ttl = max(1, math.ceil(ttl_s))
        return await self._call("lease grant", lambda c: c.lease(ttl).id)

    async def refresh(self, lease: int) -> bool:
        """Keep `lease` alive for another TTL; False when it has expired or was revoked."""
        return await self._call("lease keepalive", lambda c: Lease(lease, c).refresh()) > 0

    async def revoke(self, lease: int) -> None:
        """End `lease`: the keys attached to it are deleted at once."""
        await self._call("lease revoke", lambda c: Lease(lease, c).revoke())

    async def create(self, key: str, value: str | bytes, lease: int = 0) -> Entry | None:
        """Put `key` only if it does not exist, in one transaction. None when it was created; else the entry
        that holds it.

        etcd3gw's own `create` returns only a bool, so the transaction is written here with a range in its
        failure branch: whoever holds the key is learned in the same round trip, with no race between the two.
        """
        put: dict[str, Any] = {"key": _encode(key), "value": _encode(value)}
        if lease:
            put["lease"] = lease
        txn = {
            "compare": [{"key": _encode(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
            "success": [{"request_put": put}],
            "failure": [{"request_range": {"key": _encode(key)}}],
        }
        result = await self._call(f"create {key}", lambda c: c.transaction(txn))
        if result.get("succeeded"):  # proto3 JSON leaves a false `succeeded` out
            return None
        for response in result.get("responses", []):
            for kv in response.get("response_range", {}).get("kvs", []):
                return Entry(key, base64.b64decode(kv.get("value", "")), int(kv.get("lease", 0)),
                             int(kv.get("mod_revision", 0)))
        raise EtcdError(f"create {key}: the transaction failed but its range found no holder")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
