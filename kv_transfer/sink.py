"""Where a decode worker's KV receivers deliver: one sink shared by the TCP and the gRPC path."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kv_transfer.base import KvReceipt, KvStreamRefused, KvTransferError, TransferredKv
from kv_transfer.transfer_tokens import KvTransferTokens
from kv_transfer.wire import KvStreamVerifier
from proto import worker_pb2 as pb

if TYPE_CHECKING:  # torch-backed; this module itself stays torch-free for the simulated worker
    from kv_transfer.buffer_pool import KvBufferPool

logger = logging.getLogger(__name__)


def _adapter(digest: bytes) -> str:
    return f"LoRA adapter {digest.hex()}" if digest else "the base model"


class KvSink:
    """Opens a verifier per incoming stream, hands finished caches to `on_kv` and failures to `on_failure`.

    A stream is opened only with the one-time transfer token `tokens` issued for its request; one
    without is refused (`on_refused`, if given, counts it) and its request is left alone.
    `assembler(header, max_bytes, pool)` makes what each stream is written into: by default a
    KvAssembler (tensors); the simulated worker passes one that verifies and keeps nothing.
    """

    def __init__(self, on_kv: Callable[[TransferredKv], None], on_failure: Callable[[str, str], None],
                 tokens: KvTransferTokens, max_bytes: int | None = None, pool: KvBufferPool | None = None,
                 assembler: Callable[..., KvStreamVerifier] | None = None,
                 on_refused: Callable[[str], None] | None = None):
        if assembler is None:
            from kv_transfer.codec import KvAssembler as assembler  # torch, only when receiving tensors
        self._assembler = assembler
        self._on_kv = on_kv
        self._on_failure = on_failure
        self._on_refused = on_refused
        self.tokens = tokens
        self.max_bytes = max_bytes
        self.pool = pool

    def open(self, header: pb.KvHeader, transport: str) -> KvStreamVerifier:
        """A verifier for the stream that `header` starts on `transport` ("tcp" or "grpc"); raises
        KvStreamRefused unless the header carries the request's transfer token, which this spends.

        Receivers name the request to `reject` only once this has returned: a refused stream must not
        fail the genuine request it names.
        """
        lora_digest = self.tokens.redeem_for(header.request_id, header.transfer_token)
        if lora_digest is None:
            if self._on_refused is not None:
                self._on_refused(header.request_id)
            raise KvStreamRefused(f"KV stream for request {header.request_id!r} refused: missing/invalid or "
                                  "already used transfer token")
        opened_at = time.perf_counter()
        try:
            if header.lora_digest != lora_digest:
                raise KvTransferError(f"KV stream for request {header.request_id!r} was computed under "
                                      f"{_adapter(header.lora_digest)}; this request runs under {_adapter(lora_digest)}")
            verifier = self._assembler(header, self.max_bytes, self.pool)
        except KvTransferError as exc:
            # The genuine sender's header is unusable and its token is spent: no cache can come now.
            self._on_failure(header.request_id, str(exc))
            raise
        verifier.transport, verifier.opened_at = transport, opened_at
        return verifier

    def deliver(self, verifier: KvStreamVerifier) -> int:
        """Hand a complete stream's cache on (raises KvTransferError if nobody can take it); return its bytes."""
        kv = verifier.finish()
        kv.receipt = KvReceipt(verifier.transport, verifier.bytes_received,
                               (time.perf_counter() - verifier.opened_at) * 1000)
        self._on_kv(kv)
        return verifier.bytes_received

    def reject(self, request_id: str, verifier: KvStreamVerifier | None, message: str) -> None:
        """A stream that failed: free what it filled, and fail its request (when one was opened for it)."""
        if verifier is not None:
            verifier.discard()
        logger.warning("rejected KV stream for request %s: %s", request_id or "?", message)
        if request_id:
            self._on_failure(request_id, message)
