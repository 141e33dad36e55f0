"""VllmClient: the coordinator's calls to vLLM instances over their OpenAI HTTP API, with WorkerClient's methods
and results, so routing, retries, migration, limits and metrics run unchanged over a vLLM fleet.

One attempt on a vLLM prefill + decode pair (the AttemptRunner's order, mapped onto vLLM's handshake):
  1. `open_decode`: the stream is accepted at once (vLLM admits on arrival; it queues what it cannot run).
  2. `prefill`: the prompt on the prefill instance (completions.py, step 1); its `kv_transfer_params` are handed
     to the decode stream of the same request id.
  3. The decode stream's next read sends the request with them to the decode instance; its chunks are parsed as
     they arrive (http1.py) into tokens (pb.TokenEvents, or completions.PlainTokens for the common chunk), each
     handed to the attempt's listener inside the socket's callback once the attempt asks for that
     (`deliver_directly`), else queued for `read`. Without a prefill instance (a
     short prompt, local prefill) it sends the request alone.
Every call goes on a kept-alive connection (http1.HttpPool); the request's body is built once, for both instances.
Failures are WorkerCallErrors with the gRPC code a pdserve worker's failure would carry (failures.py then
classifies them): no connection or a reset is UNAVAILABLE, a 400 INVALID_ARGUMENT, a 5xx INTERNAL, the
request's deadline DEADLINE_EXCEEDED (one timer per call, none per read). An instance declared lost (`lose`) fails
its calls in flight at once.
"""

from __future__ import annotations

import asyncio
import time

import orjson

from coordinator.requests.request import GenerationRequest
from coordinator.workers.client import HealthReport, PrefillResult
from coordinator.workers.vllm.call_failures import call_failure, failure, status_error
from coordinator.workers.vllm.completions import UnsupportedOnVllm, completion_body, prefill_body
from coordinator.workers.vllm.decode_stream import VllmDecodeStream
from coordinator.workers.vllm.http1 import BodyAnswer, HttpConnection, HttpPool, LostInstance, StaleConnection
from coordinator.workers.vllm.load import health_report
from proto import worker_pb2 as pb
from security.secrets import SecretFile
from security.tls import LinkTls

# /metrics is ~80 KB per instance: read for the load at most this often (the health monitor's checks); a
# silence probe asks /health alone.
METRICS_MAX_AGE_S = 1.0


class _Handoff:
    """What open_decode leaves for the prefill of the same request: the body (built once for both instances, or
    why it cannot be) and the future the prefill's kv_transfer_params go to."""

    __slots__ = ("body", "refusal", "params")

    def __init__(self, body: dict | None, refusal: UnsupportedOnVllm | None, params: asyncio.Future | None):
        self.body, self.refusal, self.params = body, refusal, params


class VllmClient:
    """HTTP calls to vLLM instances (base URL by address), https with the worker link's TLS, the worker secret as
    the API key; the same calls and results as WorkerClient (module docstring)."""

    takes_sampling_pb = False  # each call's body is JSON, built from the request itself

    def __init__(self, urls: dict[str, str], tls: LinkTls | None = None, secret: SecretFile | None = None,
                 seeded_sampling: bool = True):
        self.urls = urls
        self.seeded_sampling = seeded_sampling  # False: the fleet has CPU instances (completions.completion_body)
        # Whether `health` reads the load (~80 KB of /metrics per instance): set False when no policy routes on it.
        self.read_load = True
        self._secret = secret
        self.pool = HttpPool(urls, tls.ssl_context if tls is not None else None)
        self._handoffs: dict[str, _Handoff] = {}  # request id -> what its prefill needs and gives
        self._streams: dict[str, set[VllmDecodeStream]] = {}  # address -> its decode streams not ended
        self._loads: dict[str, tuple[float, HealthReport]] = {}  # address -> (when read, the load it gave)

    @property
    def connections_dialled(self) -> int:
        """Connections opened to instances, ever (kept-alive ones are reused: steady load adds none)."""
        return self.pool.dialled

    def request_bytes(self, method: str, address: str, path: str, body: bytes | None, traceparent: str = "") -> bytes:
        """One HTTP/1.1 request to the instance at `address`, head and body."""
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.pool.host(address)}\r\n"
        if self._secret is not None:
            head += f"Authorization: Bearer {self._secret.value}\r\n"
        if traceparent:
            head += f"traceparent: {traceparent}\r\n"
        if body is None:
            return (head + "\r\n").encode()
        return (head + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body

    def open_decode(self, address: str, request: GenerationRequest, max_tokens: int, max_seq_len: int,
                    timeout: float, local_prefill: bool = False, traceparent: str = "",
                    sampling: pb.SamplingParams | None = None) -> VllmDecodeStream:
        """A decode on the vLLM instance at `address`: without `local_prefill`, it waits for the prefill of the
        same request id to hand it the KV blocks' whereabouts (module docstring)."""
        try:
            body, refusal = completion_body(request, max_tokens, request.request_id, self.seeded_sampling), None
        except UnsupportedOnVllm as exc:
            body, refusal = None, exc
        params = None if local_prefill else asyncio.get_running_loop().create_future()
        if params is not None:
            self._handoffs[request.request_id] = _Handoff(body, refusal, params)
        stream = VllmDecodeStream(self, address, request, body, refusal, timeout, params, traceparent)
        self._streams.setdefault(address, set()).add(stream)
        return stream

    async def prefill(self, address: str, request: GenerationRequest, max_tokens: int, decode_address: str,
                      timeout: float, kv_data_address: str = "", kv_transfer_token: str = "", traceparent: str = "",
                      decode_cached_tokens: int = 0, sampling: pb.SamplingParams | None = None,
                      kv_layout_version: int = 0, pull_from: str = "", pull_tokens: int = 0) -> PrefillResult:
        """Step 1 of the handshake on the prefill instance; its kv_transfer_params go to the decode stream (vLLM's
        NIXL connector agrees on its own KV layout: `kv_layout_version` is not used). `pull_from` is always empty
        here: the policy makes no peer pulls on a vLLM fleet (vLLM serves no KvPeer)."""
        if pull_from:
            raise ValueError("vLLM instances cannot pull KV from a peer")
        handoff = self._handoffs.pop(request.request_id, None)
        params = handoff.params if handoff is not None else None
        started = time.monotonic()
        try:
            try:
                if handoff is None:
                    body = completion_body(request, max_tokens, request.request_id, self.seeded_sampling)
                elif handoff.refusal is not None:
                    raise handoff.refusal
                else:
                    body = handoff.body
            except UnsupportedOnVllm as exc:
                raise failure("prefill", address, "INVALID_ARGUMENT", str(exc)) from None
            status, raw = await self.exchange("prefill", address, "POST", "/v1/completions",
                                              orjson.dumps(prefill_body(body)), timeout, traceparent)
            if status != 200:
                raise status_error("prefill", address, status, raw.decode(errors="replace"))
            answer = orjson.loads(raw)
            kv_params = answer.get("kv_transfer_params")
            if not isinstance(kv_params, dict):
                raise failure("prefill", address, "INTERNAL", "the answer carries no kv_transfer_params: is the "
                              "instance started with a NixlConnector kv_role kv_producer?")
            token_ids = (answer.get("choices") or [{}])[0].get("token_ids") or [0]
        except asyncio.CancelledError:
            if params is not None:
                params.cancel()
            raise
        except Exception as exc:
            if params is not None and not params.done():
                # The decode stream waiting on it fails with it; the attempt then reports the prefill's failure.
                params.set_exception(exc)
            raise
        elapsed_ms = (time.monotonic() - started) * 1000
        if params is not None and not params.done():
            params.set_result(kv_params)
        return PrefillResult(token_ids[0], elapsed_ms, kv_bytes=0, kv_transfer_ms=0.0, forward_ms=elapsed_ms)

    async def exchange(self, stage: str, address: str, method: str, path: str, body: bytes | None, timeout: float,
                       traceparent: str = "") -> tuple[int, bytes]:
        """(status, body) of one request to the instance, within `timeout`; failures as WorkerCallErrors."""
        request = self.request_bytes(method, address, path, body, traceparent)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout, 0.0)  # one for the call, a second try included
        for tries_left in (1, 0):
            answer = BodyAnswer()
            timer = loop.call_at(deadline, answer.fail, TimeoutError())
            connection: HttpConnection | None = None
            try:
                connection = await self.pool.send(address, request, answer, deadline)
                return await answer.result
            except StaleConnection as exc:
                if not tries_left:
                    raise call_failure(stage, address, exc) from None
            except (asyncio.CancelledError, Exception) as exc:
                if connection is not None and connection.reader is answer:
                    connection.abandon(ConnectionAbortedError("the call was left"))
                if isinstance(exc, asyncio.CancelledError):
                    raise
                raise call_failure(stage, address, exc) from None
            finally:
                timer.cancel()
                if answer.result.done() and not answer.result.cancelled():
                    answer.result.exception()  # failed while the dial was under way: what was raised says it
        raise AssertionError("unreachable")

    async def update_adapters(self, path: str, body: dict, timeout: float = 60.0) -> None:
        """POST vLLM's /v1/load_lora_adapter or /v1/unload_lora_adapter (`path`) with `body` to every instance;
        WorkerCallError naming the first that refuses."""
        for address in self.urls:
            status, raw = await self.exchange("adapter", address, "POST", path, orjson.dumps(body), timeout)
            if status != 200:
                raise status_error("adapter", address, status, raw.decode(errors="replace"))

    async def health(self, address: str, role: str, timeout: float = 2.0) -> HealthReport:
        """vLLM's /health for liveness, its /metrics for the load (load.py; at most every METRICS_MAX_AGE_S, and
        only when `read_load`)."""
        deadline = time.monotonic() + timeout
        status, raw = await self.exchange(role, address, "GET", "/health", None, timeout)
        if status != 200:
            raise status_error(role, address, status, raw.decode(errors="replace"))
        if not self.read_load:
            return HealthReport(None, draining=False)
        known = self._loads.get(address)
        if known is not None and time.monotonic() - known[0] < METRICS_MAX_AGE_S:
            return known[1]
        status, raw = await self.exchange(role, address, "GET", "/metrics", None, deadline - time.monotonic())
        if status != 200:
            raise status_error(role, address, status, raw.decode(errors="replace"))
        report = health_report(raw.decode(errors="replace"))
        self._loads[address] = (time.monotonic(), report)
        return report

    async def probe(self, address: str, role: str, timeout: float = 2.0) -> None:
        """A liveness check (the silence watch's): vLLM's /health alone; the load is read by `health` on its timer."""
        status, raw = await self.exchange(role, address, "GET", "/health", None, timeout)
        if status != 200:
            raise status_error(role, address, status, raw.decode(errors="replace"))

    async def lose(self, address: str, reason: str) -> None:
        """The instance at `address` was declared lost: its calls in flight fail as UNAVAILABLE with `reason`."""
        for stream in list(self._streams.get(address, ())):
            stream.fail(LostInstance(reason))
        self.pool.lose(address, reason)

    async def forget(self, address: str) -> None:
        """Forget its last load and its idle connections."""
        self._loads.pop(address, None)
        self.pool.close_idle(address)

    def stream_ended(self, stream: VllmDecodeStream) -> None:
        streams = self._streams.get(stream.address)
        if streams is not None:
            streams.discard(stream)
            if not streams:
                del self._streams[stream.address]

    async def close(self) -> None:
        self.pool.close()
