"""A worker's drain state: counts requests in flight, and refuses new ones once draining."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from proto import worker_pb2 as pb
from proto.failure_reason import reason_metadata


DRAINING_MESSAGE = "worker is draining: it finishes its running requests and takes no new ones"


class DrainGate:
    """Counts requests in flight; once `draining`, servers refuse new ones and wait for these to end."""

    def __init__(self):
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._abandoned = asyncio.Event()
        self._on_drain: list = []

    @contextlib.contextmanager
    def request(self):
        """Count one request in flight for its whole life (check `draining` first)."""
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    def on_drain(self, callback) -> None:
        """Call `callback()` when draining starts (long-lived streams end then, not at the server's stop)."""
        self._on_drain.append(callback)

    def start_draining(self) -> None:
        self.draining = True
        for callback in self._on_drain:
            callback()

    def abandon(self) -> None:
        """Stop waiting for requests in flight (a second signal: the operator wants out now)."""
        self._abandoned.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight, at most `timeout_s`; return whether that happened."""
        idle = asyncio.ensure_future(self._idle.wait())
        abandoned = asyncio.ensure_future(self._abandoned.wait())
        try:
            await asyncio.wait((idle, abandoned), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
            abandoned.cancel()
        return self.in_flight == 0


async def refuse_if_draining(gate: DrainGate, context: grpc.aio.ServicerContext) -> None:
    """Refuse a new request at once while draining; UNAVAILABLE tells a client to go elsewhere."""
    if gate.draining:
        await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE,
                            trailing_metadata=reason_metadata(pb.FAILURE_REASON_DRAINING))
