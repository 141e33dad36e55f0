"""A prefill worker's side of encoder disaggregation: the encoder outputs of a prompt's images pulled from the encode
workers the coordinator named, instead of encoding the files (the stream and its checks: kv_transfer/embeddings.py).

An image this worker's encoder cache holds is not pulled. A pull that fails (the encode worker gone, the image
evicted there, a stream refused) fails the request with EmbeddingsUnavailable, whose failure reason tells the
coordinator to send the file instead: it never costs the client its answer.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from kv_transfer.embeddings import EmbeddingsReceiver, EmbeddingsShape
from kv_events.block_hash import hash_to_bytes
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from security.grpc_auth import ChannelCache, secret_metadata
from worker.engine.errors import EmbeddingsUnavailable
from worker.engine.media import MediaSpan

logger = logging.getLogger(__name__)


class EmbeddingPuller:
    """Pulls images' encoder outputs for prefill requests, each verified before the engine sees it."""

    def __init__(self, channels: ChannelCache, secret, metrics, timeout_s: float):
        self.channels = channels  # the KV sender's, to the same workers (closed with it)
        self.secret = secret
        self.metrics = metrics
        self.timeout_s = timeout_s

    async def pull(self, engine, media: tuple[MediaSpan, ...], request_id: str) -> dict:
        """The outputs of the items naming an encode worker, by content hash: pulled where this worker lacks them
        (bytes), else its own (the backend's, taken now)."""
        if not any(span.encoder for span in media):
            return {}
        wanted, held = engine.embeddings_wanted(media)
        pulled = await asyncio.gather(*(self._pull_one(span, shape, request_id) for span, shape in wanted))
        return {**held, **{span.content_hash: data for (span, _), data in zip(wanted, pulled)}}

    async def _pull_one(self, span: MediaSpan, shape: EmbeddingsShape, request_id: str) -> bytearray:
        content_hash = hash_to_bytes(span.content_hash)
        receiver = EmbeddingsReceiver(content_hash, shape, span.name)
        try:
            call = pb_grpc.EncoderServiceStub(self.channels.get(span.encoder)).PullEmbeddings(
                pb.PullEmbeddingsRequest(request_id=request_id, content_hash=content_hash),
                timeout=self.timeout_s, metadata=secret_metadata(self.secret))
            async for message in call:
                receiver.take(message)
            data = receiver.finish()
        except Exception as exc:  # noqa: BLE001 (whatever failed, the coordinator sends the file instead)
            why = (f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError)
                   else str(exc))
            logger.warning("request %s: pulling the embeddings of %s from %s failed (%s)", request_id, span.name,
                           span.encoder, why)
            self.metrics.embedding_pulls.labels("failed").inc()
            raise EmbeddingsUnavailable(f"{span.name}: its embeddings could not be pulled from the encode worker "
                                        f"{span.encoder}: {why}") from None
        self.metrics.embedding_pulls.labels("pulled").inc()
        self.metrics.embedding_bytes.labels("received").inc(len(data))
        return data
