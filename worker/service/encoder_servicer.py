"""EncoderServicer: an encode worker's gRPC side (EncoderService): Encode calls onto the engine, its cached outputs
streamed to the prefill workers that pull them (kv_transfer/embeddings.py), Health."""

from __future__ import annotations

import asyncio
import logging

import grpc

from kv_events.block_hash import HASH_BYTES, hash_from_bytes, hash_to_bytes
from kv_transfer.embeddings import EMBEDDING_CHUNK_BYTES, embeddings_messages
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from worker.engine.errors import InvalidRequest
from worker.engine.media import spans_from_pb
from worker.service.drain import DrainGate, refuse_if_draining
from worker.service.errors import engine_errors_as_status
from worker.service.servicers import AnswersHealth

logger = logging.getLogger(__name__)


class EncoderServicer(AnswersHealth, pb_grpc.EncoderServiceServicer):
    """Protobuf ↔ the EncodeEngine (worker/torch_engine/encode_engine.py)."""

    def __init__(self, engine, metrics, gate: DrainGate, chunk_bytes: int = EMBEDDING_CHUNK_BYTES):
        self.engine = engine
        self.metrics = metrics
        self.gate = gate
        self.chunk_bytes = min(chunk_bytes, EMBEDDING_CHUNK_BYTES)

    async def Encode(self, request: pb.EncodeRequest, context: grpc.aio.ServicerContext) -> pb.EncodeResponse:
        await refuse_if_draining(self.gate, context)
        with self.gate.request():
            async with engine_errors_as_status(context):
                # Items come in prompt order; the prompt itself stays with the coordinator.
                prompt_len = max((item.offset + item.num_tokens for item in request.media), default=0)
                media = spans_from_pb(request.media, prompt_len, with_data=True)
                if any(span.encoder for span in media):
                    raise InvalidRequest(f"{next(s for s in media if s.encoder).name}: an Encode call carries the "
                                         "image's data, not an encode worker's address")
                outputs, busy_s = await self.engine.encode(media)
        logger.debug("request %s: %d images, %.1f ms", request.request_id, len(media), busy_s * 1000)
        reply = pb.EncodeResponse(busy_ms=busy_s * 1000)
        for span, ((rows, hidden), cached) in zip(media, outputs):
            self.metrics.encoded_images.labels("cached" if cached else "encoded").inc()
            reply.items.add(content_hash=hash_to_bytes(span.content_hash), rows=rows, hidden=hidden, cached=cached)
        return reply

    async def PullEmbeddings(self, request: pb.PullEmbeddingsRequest, context: grpc.aio.ServicerContext):
        if len(request.content_hash) != HASH_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"content_hash must be {HASH_BYTES} bytes, got "
                                f"{len(request.content_hash)}")
        with self.gate.request():  # a drain waits for the pulls under way
            held = await asyncio.to_thread(self.engine.held, hash_from_bytes(request.content_hash))
            if held is None:
                logger.debug("request %s: pulled an image not held here", request.request_id)
                await context.abort(grpc.StatusCode.NOT_FOUND, "this encode worker does not hold that image's output "
                                    "(never encoded here, or evicted since)")
            rows, hidden, dtype, data = held
            sent = 0
            for message in embeddings_messages(request.content_hash, rows, hidden, dtype, data, self.chunk_bytes):
                sent += len(message.chunk.data)
                yield message
        self.metrics.embedding_pulls.labels("served").inc()
        self.metrics.embedding_bytes.labels("sent").inc(sent)
