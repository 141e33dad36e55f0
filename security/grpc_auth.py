"""Who may call a worker's gRPC port, and the coordinator's side of it.

Server side (`CallerCheck`): control calls (Prefill, Decode, Health, and KvPeer.PullKv, which carries a
worker's KV out to a peer) must carry the worker secret
when one is configured, else UNAUTHENTICATED; with mutual TLS and a CRL, a caller whose certificate
is revoked is refused per call (gRPC's TLS has no CRL setting). KV pushes are exempt from the secret:
a decode worker admits a KV stream only with the one-time transfer token it issued for that request.
So is the standard grpc.health.v1 service: it tells serving or not and nothing more, and Kubernetes'
gRPC probes send no metadata.

Client side: `secret_metadata` is passed on every call (call metadata, not a channel interceptor, whose
wrapper would sit on every read of a token stream).
"""

from __future__ import annotations

import asyncio

import grpc

from security.secrets import SecretFile, bearer_value
from security.tls import LinkTls

SECRET_HEADER = "authorization"
KV_PUSH_METHOD = "/pdserve.v1.KvReceiver/PushKv"
STANDARD_HEALTH_PREFIX = "/grpc.health.v1.Health/"


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call."""
    async def refuse(request, context):
        await context.abort(code, message)

    async def refuse_stream(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator, as a server-streaming behaviour is

    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)


def _with_peer_check(handler: grpc.RpcMethodHandler, tls: LinkTls) -> grpc.RpcMethodHandler:
    """`handler`, refusing callers whose certificate the current CRL revokes."""
    async def revoked(context) -> bool:
        certs = context.auth_context().get("x509_pem_cert") or []
        if certs and tls.is_revoked(certs[0]):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "client certificate is revoked (in the CRL)")
        return False

    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.response_streaming:
        inner = handler.stream_stream if handler.request_streaming else handler.unary_stream

        async def stream(request, context):
            await revoked(context)
            async for item in inner(request, context):
                yield item

        make = grpc.stream_stream_rpc_method_handler if handler.request_streaming else grpc.unary_stream_rpc_method_handler
        return make(stream, **kwargs)
    inner = handler.stream_unary if handler.request_streaming else handler.unary_unary

    async def unary(request, context):
        await revoked(context)
        return await inner(request, context)

    make = grpc.stream_unary_rpc_method_handler if handler.request_streaming else grpc.unary_unary_rpc_method_handler
    return make(unary, **kwargs)


class CallerCheck(grpc.aio.ServerInterceptor):
    """Refuses calls without the worker secret (when set) and callers with revoked certificates."""

    def __init__(self, secret: SecretFile | None, tls: LinkTls | None):
        self.secret = secret
        self.tls = tls if tls is not None and tls.mutual and tls.settings.tls_crl else None

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        if self.secret is not None and not self._exempt_from_secret(details.method):
            presented = next((v for k, v in details.invocation_metadata or () if k == SECRET_HEADER), None)
            if not self.secret.matches(bearer_value(presented)):
                reason = "missing" if presented is None else "wrong"
                return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED,
                                f"{reason} worker secret: calls to this worker must carry the cluster's "
                                f"auth_config.worker_secret_file as `authorization: Bearer <secret>`")
        if self.tls is not None:
            return _with_peer_check(handler, self.tls)
        return handler

    @staticmethod
    def _exempt_from_secret(method: str) -> bool:
        return method == KV_PUSH_METHOD or method.startswith(STANDARD_HEALTH_PREFIX)


def secret_metadata(secret: SecretFile | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that carries the worker secret (read now, so a reload applies to the next call)."""
    return None if secret is None else ((SECRET_HEADER, f"Bearer {secret.value}"),)


def open_channel(address: str, tls: LinkTls | None, options) -> grpc.aio.Channel:
    """A channel to a worker, with TLS per the link when it is enabled."""
    if tls is not None:
        return grpc.aio.secure_channel(address, tls.grpc_channel_credentials(), options=options)
    return grpc.aio.insecure_channel(address, options=options)


class ChannelCache:
    """One channel per address, opened on first use. After a TLS reload, new calls open new channels and the
    old ones are closed once `grace_s` has let the calls in flight on them finish."""

    def __init__(self, tls: LinkTls | None, options, grace_s: float):
        self.tls = tls
        self.options = options
        self.grace_s = grace_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._generation = 0
        self._closing: set[asyncio.Task] = set()
        self._retired: dict[grpc.aio.Channel, str] = {}  # channels a reload retired, and their addresses

    def get(self, address: str) -> grpc.aio.Channel:
        if self.tls is not None and self.tls.generation != self._generation:
            self._generation = self.tls.generation
            for address, channel in self._channels.items():
                self._close_later(channel, address, self.grace_s)
            self._channels.clear()
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = open_channel(address, self.tls, self.options)
        return channel

    def of(self, address: str) -> list[grpc.aio.Channel]:
        """Every channel open to the address: its current one and those a reload retired, without opening one."""
        current = self._channels.get(address)
        return [c for c, a in self._retired.items() if a == address] + ([current] if current is not None else [])

    def _close_later(self, channel: grpc.aio.Channel, address: str, delay_s: float) -> None:
        async def close():
            await asyncio.sleep(delay_s)
            self._retired.pop(channel, None)
            await channel.close()

        self._retired[channel] = address
        task = asyncio.create_task(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def forget(self, address: str) -> None:
        """Close the channel of an address that left."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def drop(self, address: str) -> None:
        """Close every channel to the address now, the retired ones too: their calls end at once."""
        for channel in self.of(address):
            self._retired.pop(channel, None)
            await channel.close()
        self._channels.pop(address, None)

    async def close(self) -> None:
        for task in list(self._closing):
            task.cancel()
        for channel in [*self._channels.values(), *self._retired]:
            await channel.close()
        self._channels.clear()
        self._retired.clear()
