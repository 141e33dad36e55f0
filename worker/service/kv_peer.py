"""Peer pulls: a worker fetches a prompt's leading KV blocks from another worker instead of computing them.

Life of a pull:
  1. The coordinator places a prompt whose leading blocks another worker holds (pool or tier, any role) and the
     chosen prefill worker does not, and names that worker and the positions in the PrefillRequest (`pull_from`,
     `pull_tokens`) when its price says pulling beats computing.
  2. The prefill worker calls KvPeer.PullKv on the source (its gRPC port, with the worker secret and TLS of any
     worker-to-worker call) with the prompt's token ids.
  3. The source pins the leading blocks it holds (a tier block is loaded into its pool first), streams them in the
     prefill -> decode format (a header, xxh3-checksummed blocks, a trailer), and unpins them.
  4. The puller checks the stream as a decode worker does (its layout against its own pool's, bounds, order,
     checksums), writes it into fresh blocks of its pool and registers them in its prefix cache (its KV events
     announce them); the prompt's prefill then finds them cached.
  5. Anything failing (the source gone mid-pull, a damaged stream, no room) is logged and counted, and the
     prompt is computed: it costs a recompute, never the request.

A prompt with media or under a LoRA adapter is not pulled (its cache ids are not its token ids): it is computed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Protocol

import grpc

from kv_transfer.base import KvTransferError
from kv_transfer.wire import KvStreamVerifier, item_messages
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from security.grpc_auth import ChannelCache, secret_metadata
from worker.engine.block_pool import BlockTable

logger = logging.getLogger(__name__)


class PeerBlocks(Protocol):
    """A backend's pool blocks as KV streams (the real one's tensors; the simulated one's synthetic bytes)."""

    def header(self, request_id: str, positions: int) -> pb.KvHeader: ...
    def items(self, request_id: str, block_ids: list[int], positions: int) -> Iterator: ...
    def assembler(self, header: pb.KvHeader) -> KvStreamVerifier: ...
    def place(self, block_ids: list[int], positions: int, verified) -> None: ...


class KvPeerServicer(pb_grpc.KvPeerServicer):
    """The source's side (step 3), on every worker."""

    def __init__(self, engine, chunk_bytes: int, metrics):
        self.engine = engine
        self.chunk_bytes = chunk_bytes
        self.metrics = metrics

    async def PullKv(self, request: pb.PullKvRequest, context: grpc.aio.ServicerContext):
        pool = self.engine.pool
        if request.block_size != pool.block_size:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this worker's blocks hold {pool.block_size} "
                                f"positions, not {request.block_size}")
        table = BlockTable()
        try:
            positions = pool.pin_prefix(list(request.token_ids), request.max_tokens, table)
            if not positions:
                await context.abort(grpc.StatusCode.NOT_FOUND, "none of the prompt's leading blocks is held here")
            sent = 0
            for item in self.engine.peer_blocks.items(request.request_id, table.block_ids, positions):
                for message in item_messages(item, self.chunk_bytes):
                    sent += len(message.block.data)
                    yield message
            self.metrics.kv_pulls.labels("served").inc()
            self.metrics.kv_pull_bytes.labels("served").inc(sent)
        finally:
            pool.release(table)


class PeerPuller:
    """The puller's side (steps 2, 4 and 5), on prefill workers."""

    def __init__(self, engine, channels: ChannelCache, secret, metrics, timeout_s: float):
        self.engine = engine
        self.channels = channels  # the KV sender's, to the same workers (closed with it)
        self.secret = secret
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.pulled = self.pulled_bytes = 0  # since start, for Health

    async def pull(self, request: pb.PrefillRequest) -> int:
        """Positions of the prompt pulled into this worker's prefix cache (0: none, and the prompt is computed)."""
        if request.media or request.lora.name:
            return 0
        pool = self.engine.pool
        token_ids = list(request.prompt_token_ids)
        want = min(request.pull_tokens, len(token_ids) - 1) // pool.block_size * pool.block_size
        if want <= 0 or self._held(token_ids, want) >= want:
            return 0
        started = time.perf_counter()
        verifier = None
        try:
            call = pb_grpc.KvPeerStub(self.channels.get(request.pull_from)).PullKv(
                pb.PullKvRequest(request_id=request.request_id, token_ids=token_ids[:want], max_tokens=want,
                                 block_size=pool.block_size),
                timeout=self.timeout_s, metadata=secret_metadata(self.secret))
            async for message in call:
                if verifier is not None:
                    verifier.add_message(message)
                elif message.HasField("header"):
                    verifier = self._open(message.header, want)
                else:
                    raise KvTransferError("the pulled stream does not start with a header")
            if verifier is None:
                raise KvTransferError("the pulled stream is empty")
            positions = verifier.positions
            self._place(token_ids, positions, verifier.finish())
        except Exception as exc:  # whatever went wrong, the prompt is computed: a pull never fails a request
            why = (f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError)
                   else f"{type(exc).__name__}: {exc}")
            logger.warning("request %s: pulling %d positions from %s failed (%s); computing them",
                           request.request_id, want, request.pull_from, why)
            self.metrics.kv_pulls.labels("failed").inc()
            return 0
        finally:
            if verifier is not None:
                verifier.discard()
        self.metrics.kv_pulls.labels("pulled").inc()
        self.metrics.kv_pull_bytes.labels("pulled").inc(verifier.bytes_received)
        self.pulled += 1
        self.pulled_bytes += verifier.bytes_received
        logger.debug("request %s: pulled %d positions from %s in %.1f ms", request.request_id, positions,
                     request.pull_from, (time.perf_counter() - started) * 1000)
        return positions

    def _held(self, token_ids: list[int], want: int) -> int:
        table = BlockTable()
        held = self.engine.pool.pin_prefix(token_ids, want, table)
        self.engine.pool.release(table)
        return held

    def _open(self, header: pb.KvHeader, want: int) -> KvStreamVerifier:
        """A verifier for a stream that must be this pool's own layout, whole blocks, at most `want` positions."""
        positions = header.shape[0] if header.shape else 0
        if header.first_position or not 0 < positions <= want or positions % self.engine.pool.block_size:
            raise KvTransferError(f"the pulled stream holds positions [{header.first_position}, "
                                  f"{header.first_position + positions}), not whole blocks within [0, {want})")
        mine = self.engine.peer_blocks.header(header.request_id, positions)
        if (header.dtype, header.num_layers, list(header.shape)) != (mine.dtype, mine.num_layers, list(mine.shape)):
            raise KvTransferError(f"the pulled stream's layout ({header.dtype}, {header.num_layers} layers, "
                                  f"{list(header.shape)}) is not this worker's ({mine.dtype}, {mine.num_layers} "
                                  f"layers, {list(mine.shape)})")
        return self.engine.peer_blocks.assembler(header)

    def _place(self, token_ids: list[int], positions: int, verified) -> None:
        pool, table = self.engine.pool, BlockTable()
        if not pool.grow(table, positions, written_whole=True):
            raise KvTransferError("no free blocks for the pulled positions")
        try:
            self.engine.peer_blocks.place(table.block_ids, positions, verified)
            pool.register(table, token_ids, positions)
        finally:
            pool.release(table)  # cached now: the prefill that follows takes them
