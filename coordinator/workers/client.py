"""gRPC calls from the coordinator to workers, and requests on their token channels.

Calls return domain objects (DecodeAccepted, PrefillResult, HealthReport) and raise WorkerCallError, carrying a
classifiable WorkerFailure, instead of gRPC's own error. A decode stream's tokens are handed out as the worker's
pb.TokenEvent: TokenRelay (attempt.py) makes each the request's TokenDelta in one step, the hot path's only one.
"""

from __future__ import annotations

import asyncio
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from coordinator.requests.failures import CALL_DEADLINE_DETAILS, WorkerCallError, WorkerFailure
from coordinator.workers.instances import ReportedLoad
from coordinator.requests.request import FinishReason, GenerationRequest
from coordinator.workers.request_messages import add_draft_hints, hints_size, lora_to_pb, media_to_pb, sampling_to_pb
from coordinator.workers.token_channels import TokenChannel, TokenChannels
from kv_transfer.grpc_transport import GRPC_OPTIONS
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from proto.failure_reason import reason_from_metadata
from proto.token_channel import MAX_FRAME_BYTES
from proto.wire_versions import WireVersions, from_health
from security.grpc_auth import ChannelCache, secret_metadata
from security.secrets import SecretFile
from security.tls import LinkTls

HEALTH_STUBS = {"prefill": pb_grpc.PrefillServiceStub, "decode": pb_grpc.DecodeServiceStub,
                "encode": pb_grpc.EncoderServiceStub}
FINISH_FROM_PB = {
    pb.FINISH_REASON_EOS: FinishReason.EOS,
    pb.FINISH_REASON_STOP_STRING: FinishReason.STOP_STRING,
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_STOP_TOKEN: FinishReason.STOP_TOKEN,
}


@dataclass(frozen=True, slots=True)
class DecodeAccepted:
    """The decode worker holds KV budget for the request and waits for its cache."""

    kv_data_address: str  # its raw-TCP KV receiver; "" = push over gRPC
    kv_transfer_token: str = ""  # one-time: the prefill worker must send it with the KV cache, or is refused
    cached_tokens: int = 0  # leading prompt positions the decode worker holds already: not sent again
    kv_layout_version: int = 0  # the KV layout it reads, passed to the prefill worker (which refuses another)


@dataclass(frozen=True)
class PrefillResult:
    """A prefill that ran and handed its KV cache to the decode worker."""

    first_token_id: int
    prefill_time_ms: float  # submission to first token, on the prefill worker
    kv_bytes: int
    kv_transfer_ms: float
    forward_ms: float = 0.0  # of prefill_time_ms, the forward's


@dataclass(frozen=True)
class HealthReport:
    """A worker's answer to a health check."""

    load: ReportedLoad | None  # None: not read (a vLLM instance under a policy that does not route on load)
    draining: bool
    versions: WireVersions | None = None  # its release and wire formats (None: a vLLM instance, which has none)


def prefill_result_from_pb(reply: pb.PrefillResponse) -> PrefillResult:
    return PrefillResult(reply.first_token_id, reply.prefill_time_ms, reply.kv_bytes, reply.kv_transfer_ms,
                       reply.forward_ms)


def report_from_pb(reply: pb.HealthResponse) -> HealthReport:
    return HealthReport(ReportedLoad(
        num_running=reply.num_running, num_waiting=reply.num_waiting, kv_used_tokens=reply.kv_used_tokens,
        kv_capacity_tokens=reply.kv_capacity_tokens, queued_prompt_tokens=reply.queued_prompt_tokens,
        loras=frozenset(reply.lora_resident), tier_blocks=reply.kv_tier_blocks, tier_hit_tokens=reply.tier_hit_tokens,
        pulls=reply.kv_pulls, pulled_bytes=reply.kv_pulled_bytes,
    ), draining=reply.draining, versions=from_health(reply))


def accepted_from_pb(accepted: pb.Accepted) -> DecodeAccepted:
    return DecodeAccepted(accepted.kv_data_address, accepted.kv_transfer_token, accepted.cached_tokens,
                          accepted.kv_layout_version)


def _call_error(stage: str, address: str, exc: grpc.aio.AioRpcError) -> WorkerCallError:
    return WorkerCallError(WorkerFailure(stage, address, exc.code().name, exc.details() or "",
                                         reason_from_metadata(exc.trailing_metadata())))


def _channel_error(stage: str, address: str, error: pb.ChannelError) -> WorkerCallError:
    return WorkerCallError(WorkerFailure(stage, address, error.code, error.details, error.reason))


class LostChannels:
    """gRPC channels closed because their worker was declared lost. Closing a channel cancels its calls;
    a call cancelled that way (and not by its own task) ends as the UNAVAILABLE a connection reset gives."""

    def __init__(self):
        self._reasons: weakref.WeakKeyDictionary[grpc.aio.Channel, str] = weakref.WeakKeyDictionary()

    def mark(self, channel: grpc.aio.Channel, reason: str) -> None:
        self._reasons[channel] = reason

    def instead(self, cancelled: asyncio.CancelledError, channel: grpc.aio.Channel, stage: str,
                address: str) -> BaseException:
        """What a `stage` call on `channel` that raised `cancelled` ends with: the worker's loss, or the
        cancellation itself when its own task was cancelled."""
        reason = self._reasons.get(channel)
        task = asyncio.current_task()
        if reason is None or (task is not None and task.cancelling()):
            return cancelled
        return WorkerCallError(WorkerFailure(stage, address, "UNAVAILABLE", reason))


class DecodeStream:
    """An open Decode call: `DecodeAccepted` first, then one pb.TokenEvent per token (its finish_reason set on the
    last: its `index` counts from 0 within this stream)."""

    def __init__(self, address: str, call, channels: TokenChannels, channel: grpc.aio.Channel, lost: LostChannels):
        self.address = address
        self._call = call
        self._channels = channels
        self._channel = channel
        self._lost = lost

    async def read(self) -> DecodeAccepted | pb.TokenEvent | None:
        """The next event; None when the worker ended the stream."""
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise _call_error("decode", self.address, exc) from None
        except asyncio.CancelledError as exc:
            raise self._lost.instead(exc, self._channel, "decode", self.address) from None
        if msg is grpc.aio.EOF:
            return None
        if msg.WhichOneof("event") == "accepted":
            self._channels.learn(self.address, msg.accepted.token_channel_address)
            return accepted_from_pb(msg.accepted)
        return msg.token

    def deliver_directly(self, take: Callable[[pb.TokenEvent], bool], flush: Callable[[], None]) -> None:
        """Nothing to do: a gRPC stream's messages come only through `read`."""

    def cancel(self) -> None:
        self._call.cancel()


class ChannelDecodeStream:
    """A decode request on the worker's token channel: the same events as a DecodeStream, and a worker's
    failure, or the deadline passing, as the same WorkerCallError its Decode call would have ended with."""

    def __init__(self, address: str, channel: TokenChannel, request: pb.DecodeRequest, timeout_s: float,
                 draft_hints: tuple[bytes, ...] = ()):
        self.address = address
        self._channel = channel
        self._request_id = request.request_id
        framed = pb.TokenChannelRequest(decode=request, timeout_s=timeout_s)
        # Parsed straight into the frame's message: on `request`, they would be sized and copied in once more each.
        add_draft_hints(framed.decode, draft_hints)
        self._sink = channel.submit(request.request_id, framed)
        self._ended = False
        # The worker ends it at its deadline too; this clock holds when the worker cannot (frozen, cut off).
        self._deadline = asyncio.get_running_loop().call_later(timeout_s, self._expire) if timeout_s > 0 else None

    async def read(self) -> DecodeAccepted | pb.TokenEvent:
        event = await self._sink.next()
        kind = event.WhichOneof("event")
        if kind == "token":
            token = event.token
            if token.finish_reason:
                self._release(cancel=False)
            return token
        if kind == "accepted":
            return accepted_from_pb(event.accepted)
        self._release(cancel=False)
        raise _channel_error("decode", self.address, event.error)

    def deliver_directly(self, take: Callable[[pb.TokenEvent], bool], flush: Callable[[], None]) -> None:
        """Offer each token to `take` inside the frame's callback as it arrives (TokenSink.deliver_tokens)."""
        self._sink.deliver_tokens(take, flush, routed=True)

    def _expire(self) -> None:
        # Read as the worker's own end of the request at its deadline would be (serve_as_call).
        self._sink.push(pb.RoutedEvent(request_id=self._request_id, error=pb.ChannelError(
            code=grpc.StatusCode.DEADLINE_EXCEEDED.name, details=CALL_DEADLINE_DETAILS,
            reason=pb.FAILURE_REASON_CALL_DEADLINE)))
        self.cancel()

    def cancel(self) -> None:
        self._release(cancel=True)

    def _release(self, cancel: bool) -> None:
        """Once: the channel forgets it (telling the worker to stop, with `cancel`) and the deadline is off."""
        if self._ended:
            return
        self._ended = True
        self._channel.release(self._request_id, cancel)
        if self._deadline is not None:
            self._deadline.cancel()


async def ask_on_channel(channel: TokenChannel, request_id: str, request: pb.TokenChannelRequest, answer: str,
                         timeout_s: float, stage: str):
    """A one-answer request (a prefill, a health probe) on the worker's token channel: its `answer` event's
    message, or the WorkerCallError the gRPC call would have ended with (its deadline passing, the worker's
    status, the channel lost); the worker is told to stop when the caller gives up first."""
    address = channel.worker_address
    sink = channel.submit(request_id, request)
    event = None
    try:
        async with asyncio.timeout(timeout_s):
            event = await sink.next()
    except TimeoutError:
        raise WorkerCallError(WorkerFailure(stage, address, grpc.StatusCode.DEADLINE_EXCEEDED.name,
                                            CALL_DEADLINE_DETAILS, pb.FAILURE_REASON_CALL_DEADLINE)) from None
    finally:
        channel.release(request_id, cancel=event is None)
    kind = event.WhichOneof("event")
    if kind == answer:
        return getattr(event, answer)
    if kind == "error":
        raise _channel_error(stage, address, event.error)
    raise WorkerCallError(WorkerFailure(stage, address, grpc.StatusCode.UNKNOWN.name,
                                        f"a {answer} request answered with a {kind} event"))


DecodeCall = DecodeStream | ChannelDecodeStream
MAX_REQUEST_FRAME_BYTES = MAX_FRAME_BYTES // 2


class WorkerClient:
    """gRPC calls to workers over cached channels: TLS per `tls`, `secret` on every call."""

    takes_sampling_pb = True  # its calls carry the request's sampling as pb.SamplingParams

    def __init__(self, tls: LinkTls | None = None, secret: SecretFile | None = None):
        # A request may run for up to exception_config.infer_timeout (at most an hour) on a channel a reload retired.
        self._channels = ChannelCache(tls, GRPC_OPTIONS, grace_s=3600)
        self._secret = secret
        self.token_channels = TokenChannels(tls, secret)
        self._stubs: dict[tuple[type, str, grpc.aio.Channel], object] = {}
        self._lost = LostChannels()
        self._probes = itertools.count()  # health probes' ids on token channels

    def _stub(self, kind: type, address: str) -> tuple[grpc.aio.Channel, object]:
        """The address's current channel and a stub on it, made once (a stub builds a callable per method)."""
        channel = self._channels.get(address)
        stub = self._stubs.get((kind, address, channel))
        if stub is None:
            stub = self._stubs[kind, address, channel] = kind(channel)
        return channel, stub

    def open_decode(self, address: str, request: GenerationRequest, max_tokens: int, max_seq_len: int, timeout: float,
                    local_prefill: bool = False, traceparent: str = "",
                    sampling: pb.SamplingParams | None = None) -> DecodeCall:
        """Start a decode, on the worker's token channel when one is open, else as a Decode call (with
        `local_prefill`, the decode worker prefills the prompt itself; the worker's spans join `traceparent`;
        `sampling`: the request's sampling_to_pb, when the caller made it already)."""
        # The prompt always goes: the decode worker hashes its blocks (prefix cache) and recomputes a preempted
        # sequence from it.
        message = pb.DecodeRequest(
            request_id=request.request_id,
            prompt_len=len(request.prompt_token_ids),
            sampling=sampling if sampling is not None else sampling_to_pb(request, max_tokens),
            max_seq_len=max_seq_len,
            prompt_token_ids=request.prompt_token_ids,
            local_prefill=local_prefill,
            traceparent=traceparent,
            media=media_to_pb(request.media, with_data=local_prefill),
            lora=lora_to_pb(request),
        )
        if request.no_drafts:
            message.no_drafts = True
        if request.held_text_tokens:
            message.held_text_tokens = request.held_text_tokens
        hints = request.draft_hints
        channel = self.token_channels.open_channel(address)
        # A request too big for one frame goes as a call: the channel would be cut, failing its other requests.
        if channel is not None and message.ByteSize() + hints_size(hints) < MAX_REQUEST_FRAME_BYTES:
            return ChannelDecodeStream(address, channel, message, timeout, hints)
        add_draft_hints(message, hints)
        grpc_channel, stub = self._stub(pb_grpc.DecodeServiceStub, address)
        call = stub.Decode(message, timeout=timeout, metadata=secret_metadata(self._secret))
        return DecodeStream(address, call, self.token_channels, grpc_channel, self._lost)

    async def prefill(
        self, address: str, request: GenerationRequest, max_tokens: int, decode_address: str, timeout: float,
        kv_data_address: str = "", kv_transfer_token: str = "", traceparent: str = "", decode_cached_tokens: int = 0,
        sampling: pb.SamplingParams | None = None, kv_layout_version: int = 0, pull_from: str = "",
        pull_tokens: int = 0,
    ) -> PrefillResult:
        """Prefill on `address` and push the KV cache to the decode worker that answered `accepted` with
        `kv_data_address`, `kv_transfer_token`, `cached_tokens` (passed as `decode_cached_tokens`: positions it
        holds already, not sent) and `kv_layout_version` (the KV layout it reads); `sampling` as in open_decode;
        `pull_from`: the instance it first pulls the prompt's leading `pull_tokens` positions from."""
        message = pb.PrefillRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=sampling if sampling is not None else sampling_to_pb(request, max_tokens),
            decode_address=decode_address,
            kv_data_address=kv_data_address,
            kv_transfer_token=kv_transfer_token,
            decode_cached_tokens=decode_cached_tokens,
            kv_layout_version=kv_layout_version,
            traceparent=traceparent,
            media=media_to_pb(request.media, with_data=True),
            lora=lora_to_pb(request),
            pull_from=pull_from,
            pull_tokens=pull_tokens,
        )
        channel = self.token_channels.open_channel(address)
        if channel is not None and message.ByteSize() < MAX_REQUEST_FRAME_BYTES:
            request = pb.TokenChannelRequest(prefill=message, timeout_s=timeout)
            return prefill_result_from_pb(await ask_on_channel(channel, message.request_id, request, "prefilled",
                                                               timeout, "prefill"))
        grpc_channel, stub = self._stub(pb_grpc.PrefillServiceStub, address)
        try:
            reply = await stub.Prefill(message, timeout=timeout, metadata=secret_metadata(self._secret))
        except grpc.aio.AioRpcError as exc:
            raise _call_error("prefill", address, exc) from None
        except asyncio.CancelledError as exc:
            raise self._lost.instead(exc, grpc_channel, "prefill", address) from None
        self.token_channels.learn(address, reply.token_channel_address, "prefill")
        return prefill_result_from_pb(reply)

    async def health(self, address: str, role: str, timeout: float = 2.0) -> HealthReport:
        """The worker's Health answer: on its token channel when one is open (a frame each way, where a call costs
        ~0.3 ms of CPU here: what probing a large fleet costs), else a call."""
        token_channel = self.token_channels.open_channel(address)
        if token_channel is not None and token_channel.answers_health:
            probe = f"health-probe-{next(self._probes)}"
            reply = await ask_on_channel(token_channel, probe, pb.TokenChannelRequest(health=probe), "health",
                                         timeout, role)
            return report_from_pb(reply)
        channel, stub = self._stub(HEALTH_STUBS[role], address)
        try:
            reply = await stub.Health(pb.HealthRequest(), timeout=timeout, metadata=secret_metadata(self._secret))
        except grpc.aio.AioRpcError as exc:
            raise _call_error(role, address, exc) from None
        except asyncio.CancelledError as exc:
            raise self._lost.instead(exc, channel, role, address) from None
        return report_from_pb(reply)

    async def encode(self, address: str, request: pb.EncodeRequest, timeout: float) -> pb.EncodeResponse:
        """Have the encode worker at `address` encode (or find cached) the request's images."""
        channel, stub = self._stub(pb_grpc.EncoderServiceStub, address)
        try:
            return await stub.Encode(request, timeout=timeout, metadata=secret_metadata(self._secret))
        except grpc.aio.AioRpcError as exc:
            raise _call_error("encode", address, exc) from None
        except asyncio.CancelledError as exc:
            raise self._lost.instead(exc, channel, "encode", address) from None

    async def probe(self, address: str, role: str, timeout: float = 2.0) -> None:
        """A liveness check (the silence watch's): the Health answer, whose load comes with it at no extra cost."""
        await self.health(address, role, timeout)

    async def switch_role(self, address: str, role: str, drain_timeout_s: float, timeout: float = 30.0) -> int:
        """Tell the worker to switch to `role` in place (WorkerControl.SwitchRole); it answers once deregistered,
        with the number of requests it had in flight. WorkerCallError when it refuses or cannot be reached."""
        _, stub = self._stub(pb_grpc.WorkerControlStub, address)
        try:
            reply = await stub.SwitchRole(pb.SwitchRoleRequest(role=role, drain_timeout_s=drain_timeout_s),
                                          timeout=timeout, metadata=secret_metadata(self._secret))
        except grpc.aio.AioRpcError as exc:
            raise _call_error("switch", address, exc) from None
        return reply.in_flight

    def watch_kv_events(self, address: str):
        """The worker's KvEvents.Watch call (a stream of pb.KvEventBatch: a snapshot, then every change)."""
        _, stub = self._stub(pb_grpc.KvEventsStub, address)
        return stub.Watch(pb.WatchKvEventsRequest(), metadata=secret_metadata(self._secret))

    async def lose(self, address: str, reason: str) -> None:
        """The worker at `address` was declared lost: every call in flight to it fails as UNAVAILABLE with
        `reason` (closing its connections), and the next call opens new ones."""
        for channel in self._channels.of(address):
            self._lost.mark(channel, reason)
        self.token_channels.lose(address, reason)
        self._stubs = {key: stub for key, stub in self._stubs.items() if key[1] != address}
        await self._channels.drop(address)

    async def forget(self, address: str) -> None:
        """Close the channels of an instance that left."""
        self._stubs = {key: stub for key, stub in self._stubs.items() if key[1] != address}
        self.token_channels.forget(address)
        await self._channels.forget(address)

    async def close(self) -> None:
        self.token_channels.close()
        await self._channels.close()
