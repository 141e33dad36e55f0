"""Where a decode worker's KV receivers deliver: one sink shared by the TCP and the gRPC path."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from kv_transfer.base import TransferredKv
from kv_transfer.wire import KvStreamVerifier
from proto import worker_pb2 as pb

if TYPE_CHECKING:  # torch-backed; this module itself stays torch-free for the simulated worker
    from kv_transfer.buffer_pool import KvBufferPool

logger = logging.getLogger(__name__)


class KvSink:
    """Opens a verifier per incoming stream, hands finished caches to `on_kv` and failures to `on_failure`.

    `assembler(header, max_bytes, pool)` makes what each stream is written into: by default a
    KvAssembler (tensors); the simulated worker passes one that verifies and keeps nothing.
    """

    def __init__(self, on_kv: Callable[[TransferredKv], None], on_failure: Callable[[str, str], None],
                 max_bytes: int | None = None, pool: KvBufferPool | None = None,
                 assembler: Callable[..., KvStreamVerifier] | None = None):
        if assembler is None:
            from kv_transfer.codec import KvAssembler as assembler  # torch, only when receiving tensors
        self._assembler = assembler
        self._on_kv = on_kv
        self._on_failure = on_failure
        self.max_bytes = max_bytes
        self.pool = pool

    def open(self, header: pb.KvHeader) -> KvStreamVerifier:
        """A verifier for the stream that `header` starts."""
        return self._assembler(header, self.max_bytes, self.pool)

    def deliver(self, verifier: KvStreamVerifier) -> int:
        """Hand a complete stream's cache on (raises KvTransferError if nobody can take it); return its bytes."""
        self._on_kv(verifier.finish())
        return verifier.bytes_received

    def reject(self, request_id: str, verifier: KvStreamVerifier | None, message: str) -> None:
        """A stream that failed: free what it filled, and fail its request (when the header named one)."""
        if verifier is not None:
            verifier.discard()
        logger.warning("rejected KV stream for request %s: %s", request_id or "?", message)
        if request_id:
            self._on_failure(request_id, message)
