"""A request's images on encode workers (encoder disaggregation): encoded once per cluster, their outputs pulled by
the prefill worker instead of encoding the files.

Life of a request's images:
  1. `start`, as the request joins the coordinator's line: without a routable encode worker, or images, nothing
     happens. An image an encode worker holds (the embeddings index, built from encode workers' KV events, one
     per image) is named to the prefill worker at once, without a call: nothing to encode, no file to send.
     Every other distinct image goes to the least loaded encode worker (its Encode calls in flight from here,
     and the images it reported waiting or running); one Encode call per encode worker, in a task, so encoding
     overlaps the wait in the line (an encode worker decodes and encodes an image once, however many calls
     bring it at once).
  2. `placed`, at the request's turn: it waits for the calls (the `encode` phase); each image an encode worker
     answered for is named to the prefill worker by that worker's address (MediaInput.encoder).
  3. A call that fails (the worker gone, draining, too slow: each call has until the request's deadline, at most
     `timeout_s`) is tried once on another encode worker; failing again, or with none left, the image keeps its
     file and the prefill worker encodes it, as without encoders (`fallback`). An image the encode worker refuses
     (INVALID_ARGUMENT: it does not decode, or does not fit its positions) is the client's 400.
  4. Later, a prefill worker that cannot pull an output (its encode worker lost since, or the image evicted
     there) fails the attempt with EMBEDDINGS_UNAVAILABLE; the pipeline routes it again at once with the files,
     without counting a retry (pipeline.py). A prefill worker, or a cluster, that does not all read the
     embeddings format is sent the files (attempt.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import Counter

from coordinator.errors import ApiError
from coordinator.requests.failures import WorkerCallError
from coordinator.requests.request import GenerationRequest, MediaInput
from coordinator.scheduling.kv_index import KvIndex
from coordinator.workers.client import WorkerClient
from coordinator.workers.instances import Instance, InstanceRegistry
from coordinator.workers.request_messages import media_to_pb
from proto import worker_pb2 as pb

logger = logging.getLogger(__name__)

OUTCOMES = ("cached", "encoded", "fallback", "pull_failed")


class EncoderCounters:
    """pdserve_encoder_images_total: each image of a request by what became of it on the encode workers."""

    def __init__(self, registry=None):
        self.images = Counter("pdserve_encoder_images_total", "Images of requests by their encoder outcome: cached "
                              "(an encode worker held its output), encoded (one encoded it now), fallback (no encode "
                              "worker could: the prefill worker was sent the file) or pull_failed (the prefill worker "
                              "could not pull its output and was sent the file instead).", ["outcome"],
                              registry=registry) if registry is not None else None
        for outcome in OUTCOMES if self.images is not None else ():
            self.images.labels(outcome)

    def count(self, outcome: str, images: int = 1) -> None:
        if self.images is not None and images:
            self.images.labels(outcome).inc(images)


class ImageEncoding:
    """The encoder phase of every request (life cycle above); `index`: the encode workers' cached images."""

    def __init__(self, client: WorkerClient, registry: InstanceRegistry, index: KvIndex, timeout_s: float,
                 counters: EncoderCounters | None = None):
        self.client = client
        self.registry = registry
        self.index = index
        self.timeout_s = timeout_s
        self.counters = counters or EncoderCounters()
        self.on_encoded = None  # the planner's: each answered call's seconds and the images it encoded
        self.in_flight: dict[int, str] = {}  # image → the encode worker an Encode call took it to, until it answers

    def start(self, request: GenerationRequest, deadline: float) -> EncodingCalls | None:
        """The request's images sent to encode workers, each call within `timeout_s` and the request's `deadline`
        (time.monotonic); None when there is nothing to do."""
        images = {m.content_hash: m for m in request.media if m.data}
        if not images or not self.registry.available("encode"):
            return None
        return EncodingCalls(self, request.request_id, images, deadline)

    def choose(self, image: MediaInput, exclude: set[str]) -> Instance | None:
        """An encode worker holding the image, else the least loaded one (none: every one excluded)."""
        candidates = self.registry.available("encode", exclude)
        if not candidates:
            return None
        # The worker encoding it for another request now, else one holding it: encoded once, where it will be held.
        holding = {*self.index.holders(image.content_hash), self.in_flight.get(image.content_hash)}
        return min(candidates, key=lambda i: (i.address not in holding, _load(i), i.address))

    def holder(self, image: MediaInput) -> Instance | None:
        """The least loaded routable encode worker whose cache holds the image, as its KV events say."""
        holding = self.index.holders(image.content_hash)
        candidates = [i for i in self.registry.available("encode") if i.address in holding] if holding else ()
        return min(candidates, key=lambda i: (_load(i), i.address), default=None)


def _load(instance: Instance) -> int:
    return instance.outstanding_requests + instance.reported.num_waiting + instance.reported.num_running


class EncodingCalls:
    """One request's Encode calls, started at once, awaited at its turn."""

    def __init__(self, encoding: ImageEncoding, request_id: str, images: dict[int, MediaInput], deadline: float):
        self.encoding = encoding
        self.request_id = request_id
        self.deadline = deadline
        self.started = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._encode_all(images))

    async def placed(self, request: GenerationRequest, trace) -> GenerationRequest:
        """The request with each image an encode worker holds named to be pulled from it."""
        try:
            encoders = await self._task
        finally:
            trace.phase("encode", self.started, time.monotonic())
        return request.with_encoders(encoders)

    def cancel(self) -> None:
        if self._task.done():
            if not self._task.cancelled():
                self._task.exception()  # retrieved: its request left the line first, nobody waits for it
        else:
            self._task.cancel()

    async def _encode_all(self, images: dict[int, MediaInput]) -> dict[int, str]:
        held: dict[int, str] = {}
        groups: dict[Instance, list[MediaInput]] = {}
        for image in images.values():
            holder = self.encoding.holder(image)
            if holder is not None:
                held[image.content_hash] = holder.address
                continue
            instance = self.encoding.choose(image, set())
            if instance is not None:
                groups.setdefault(instance, []).append(image)
        self.encoding.counters.count("cached", len(held))
        results = await asyncio.gather(*(self._encode(instance, group) for instance, group in groups.items()))
        encoders = {h: address for found in (held, *results) for h, address in found.items()}
        self.encoding.counters.count("fallback", len(images) - len(encoders))
        return encoders

    async def _encode(self, instance: Instance, images: list[MediaInput]) -> dict[int, str]:
        """The images' hashes → the encode worker holding them: `instance`, or another once it failed."""
        tried: set[str] = set()
        while instance is not None:
            tried.add(instance.address)
            try:
                reply = await self._call(instance, images)
            except WorkerCallError as exc:
                failure = exc.failure
                if failure.code == "INVALID_ARGUMENT":  # the image itself (its field named): another cannot help
                    raise ApiError(400, f"the encode worker refused an image: {failure.details}") from None
                self.encoding.registry.record_failure(instance, failure.circuit_reason,
                                                      gone=failure.kind.opens_circuit)
                failed, instance = instance, self.encoding.choose(images[0], tried) if len(tried) < 2 else None
                logger.warning("request %s: encoding %d images on %s failed (%s: %s); %s", self.request_id,
                               len(images), failed.address, failure.code, failure.details,
                               f"trying {instance.address}" if instance is not None else "sending the files instead")
                continue
            encoded = sum(not item.cached for item in reply.items)
            self.encoding.counters.count("encoded", encoded)
            self.encoding.counters.count("cached", len(reply.items) - encoded)
            if self.encoding.on_encoded is not None:
                self.encoding.on_encoded(reply.busy_ms / 1000, encoded)
            return {image.content_hash: instance.address for image in images}
        return {}

    async def _call(self, instance: Instance, images: list[MediaInput]) -> pb.EncodeResponse:
        message = pb.EncodeRequest(request_id=self.request_id,
                                   media=media_to_pb(sorted(images, key=lambda m: m.offset), with_data=True))
        in_flight = self.encoding.in_flight
        for image in images:
            in_flight[image.content_hash] = instance.address
        try:
            timeout = max(0.001, min(self.encoding.timeout_s, self.deadline - time.monotonic()))
            with self.encoding.registry.lease(instance):
                return await self.encoding.client.encode(instance.address, message, timeout)
        finally:
            for image in images:
                if in_flight.get(image.content_hash) == instance.address:
                    del in_flight[image.content_hash]
